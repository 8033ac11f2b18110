"""Build and run the arq worker. ``redpacket worker`` runs it as its own process."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any, cast

from arq import Worker
from arq.cron import cron
from arq.worker import func

from server.core import Core
from server.queue import CREDIT_GRAB, job_deserializer, job_serializer
from worker.credit import CreditBatcher, credit_grab_job
from worker.drain import CreditDrain
from worker.metrics import WorkerMetrics
from worker.settle import announce_job, reconcile_job, refund_expired_job, score_bots_job, sweep_job

# A credit job's result is kept this long; while it is, enqueueing the same grab again is a no-op.
KEEP_RESULT_SECONDS = 24 * 3600


def job_functions() -> tuple[list[Any], list[Any]]:
    """Every job and cron job the worker runs."""
    functions = [func(cast(Any, credit_grab_job), name=CREDIT_GRAB, max_tries=20)]
    crons = [
        cron(cast(Any, refund_expired_job), second=0, unique=True, timeout=600),
        cron(cast(Any, announce_job), second=set(range(2, 60, 5)), unique=True, timeout=60),
        cron(cast(Any, sweep_job), second={15, 45}, unique=True, timeout=300),
        cron(cast(Any, reconcile_job), minute=set(range(0, 60, 10)), second=30, unique=True, timeout=600),
        cron(cast(Any, score_bots_job), second=set(range(5, 60, 10)), unique=True, timeout=60),
    ]
    return functions, crons


def make_worker(core: Core, metrics: WorkerMetrics | None = None, **overrides: Any) -> Worker:
    """A worker that runs every job family against ``core``'s database, on its queue."""
    metrics = metrics or WorkerMetrics()
    functions, crons = job_functions()
    options: dict[str, Any] = {
        # arq types ctx as a plain dict; our jobs take the TypedDict that says what is in it.
        "functions": functions,
        "cron_jobs": crons,
        "redis_pool": core.redis,
        "queue_name": core.settings.queue_name,
        "ctx": {"core": core, "batcher": CreditBatcher(core.db, metrics), "metrics": metrics},
        "job_serializer": job_serializer,
        "job_deserializer": job_deserializer,
        "keep_result": KEEP_RESULT_SECONDS,
        # Enough jobs at once to fill credit batches, but fewer than Redis connections (the pool is not
        # first-come-first-served: more waiters than connections starve some past its timeout).
        "max_jobs": max(10, core.settings.redis_pool_size - 16),
        "handle_signals": False,
        "health_check_interval": 60,
    }
    options.update(overrides)
    return Worker(**options)


@contextlib.asynccontextmanager
async def running_worker(core: Core) -> AsyncIterator[None]:
    """A worker and a credit drain in this process for the duration of the block (``redpacket up``)."""
    metrics = WorkerMetrics()
    worker = make_worker(core, metrics)
    tasks = [asyncio.create_task(worker.async_run()), asyncio.create_task(CreditDrain(core, metrics).run())]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
