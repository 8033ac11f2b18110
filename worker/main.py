"""The worker: the credit drain, arq running the periodic jobs, and a health heartbeat, all in one process
(``redpacket worker``, or beside the hub under ``redpacket up``).

Every part rides out Redis and the database going away on its own: the drain retries with back-off,
arq's loop (which stops on the first Redis error) is started again with back-off, and the heartbeat
just stops beating until both answer again. Nothing needs a supervisor to restart the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, cast

from arq import Worker
from arq.cron import cron
from prometheus_client import CollectorRegistry

from server.core import Core
from server.live import seen
from server.money import endpoints
from server.probe import ask_own, own_url
from server.settings import Settings
from server.stopping import check_cancelled, stop
from server.store import keys
from server.store.backlog import backlog
from server.store.identities import eviction_problem
from server.store.masters import durability_degraded
from server.store.queue import job_deserializer, job_serializer
from worker.drain import CreditDrain
from worker.metrics import WorkerMetrics
from worker.outages import DATABASE, REDIS
from worker.settle import (
    Ctx,
    announce_job,
    expire_holds_job,
    reconcile_job,
    refund_expired_job,
    score_bots_job,
    sweep_job,
)
from worker.webhooks import Dispatcher

log = logging.getLogger(__name__)

# How often the heartbeat checks Redis and the database; `redpacket worker --check` wants a beat newer
# than HEALTHY_WITHIN seconds.
BEAT_SECONDS = seen.BEAT_SECONDS  # (each beat says this worker is alive too: server.live.seen)
# How this worker is listed among the processes seen (``server.live.seen``).
WORKER_ID = uuid.uuid4().hex[:12]
HEALTHY_WITHIN = 30.0


# A worker process's garbage collection (``collecting_as_a_worker``): the drain makes some 40 objects a
# credit, and at CPython's thresholds (700, 10, 10) a 20,000-credit drain ran 120 young collections and a
# full one, 85 ms of its time (4 µs a credit, 6 %); with these, and start-up objects frozen, 5-13 ms
# (docs/benchmarks.md). The hub's are the same (``server.cli.serve``).
GC_THRESHOLD = (20_000, 20, 100)


@contextlib.contextmanager
def collecting_as_a_worker() -> Iterator[None]:
    """While it lasts, what exists at its start stays out of every collection (``gc.freeze``) and the young
    generation is collected every ``GC_THRESHOLD[0]`` allocations: a process draining credits. Then the
    collector is as it was (a bench run inside the tests leaves nothing behind)."""
    before = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLD)
    try:
        yield
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()


def cron_jobs(namespace: str) -> list[Any]:
    """Every periodic job; arq's ``unique`` runs each tick once across workers — of this deployment: a
    tick's job id holds the job's name, so the name holds the namespace (another deployment's workers on
    the same queue server run their own)."""

    def named(job: Callable[[Ctx], Awaitable[object]], **when: Any) -> Any:
        return cron(transient_is_a_line(job), name=cron_name(namespace, job), unique=True, **when)

    return [
        named(refund_expired_job, second=0, timeout=600),
        named(expire_holds_job, second=30, timeout=600),
        named(announce_job, second=set(range(2, 60, 5)), timeout=60),
        named(sweep_job, second={15, 45}, timeout=300),
        # Also once at the start: until a worker has reconciled, its gauges say nothing (not "0").
        named(reconcile_job, minute=set(range(0, 60, 10)), second=30, timeout=600, run_at_startup=True),
        named(score_bots_job, second=set(range(5, 60, 10)), timeout=60),
    ]


def cron_name(namespace: str, job: Callable[[Ctx], Awaitable[object]]) -> str:
    """A periodic job's name in arq (by which it can also be queued at once: ``bench storm
    --reconcile-at``). A deployment from before namespaces keeps arq's own name, "cron:<job>": workers of
    the old and the new version side by side in a rolling upgrade run each other's ticks."""
    return f"{namespace or 'cron'}:{job.__name__}"


def transient_is_a_line(job: Callable[[Ctx], Awaitable[object]]) -> Any:
    """``job``, whose failure on Redis or the database being away (a restart, a failover) is counted in the
    outage (``worker.outages``: one line when it starts, one when it ends) and no result: the next run of
    the cron tries again. Any other failure is arq's to report."""

    @functools.wraps(job)
    async def run(ctx: Ctx) -> object:
        try:
            return await job(ctx)
        except Exception as e:
            if not ctx["metrics"].outages.failed(job.__name__, e):
                raise
            return None  # (said once for the outage: left for the next run)

    return run


def make_worker(core: Core, metrics: WorkerMetrics | None = None, **overrides: Any) -> Worker:
    """arq's worker running the periodic jobs against ``core``, on its queue."""
    options: dict[str, Any] = {
        "functions": [],
        "cron_jobs": cron_jobs(core.namespace),
        "redis_pool": core.queue,
        "queue_name": core.queue_name,
        # arq types ctx as a plain dict; our jobs take the TypedDict that says what is in it.
        "ctx": {"core": core, "metrics": metrics or WorkerMetrics()},
        "job_serializer": job_serializer,
        "job_deserializer": job_deserializer,
        "handle_signals": False,
        "health_check_interval": 60,
    }
    options.update(overrides)
    return Worker(**options)


async def run_arq(core: Core, metrics: WorkerMetrics) -> None:
    """arq's loop, until cancelled. arq stops at the first Redis error; here a new loop starts after a
    back-off (0.1 s doubling to 5 s), so an outage of any length ends with the crons running again."""
    failures = 0
    while True:
        worker = make_worker(core, metrics)
        started = time.monotonic()
        loop = asyncio.create_task(worker.async_run())
        try:
            await asyncio.shield(loop)
            return
        except asyncio.CancelledError:
            # arq's loop checks nothing: cancelled until it ends (a cancel it swallows: server.stopping).
            await stop([loop], "arq's loop", again_every=0.1)
            raise
        except Exception as e:
            if time.monotonic() - started > 30:
                failures = 0  # it ran for a while: this is a new outage
            failures += 1
            if failures == 1:
                log.warning(
                    "arq's loop stopped (%s: %s); starting it again with back-off", type(e).__name__, e
                )
        finally:
            # Its running jobs (a refund half-way, say) are idempotent: cancelled now, run again later.
            await stop(worker.tasks.values(), "arq's jobs")
        await asyncio.sleep(min(0.1 * 2 ** (failures - 1), 5.0))


async def heartbeat(core: Core, metrics: WorkerMetrics) -> None:
    """Beat (``metrics.healthy_at``) every ``BEAT_SECONDS`` while Redis and the database both answer;
    read the credit backlog and each Redis master's CPU, memory and durability for the metrics."""
    degraded: dict[str, str] = {}
    while True:
        check_cancelled()
        reached = 0
        for service in (REDIS, DATABASE):
            try:
                await (_every_master(core) if service == REDIS else core.db.fetchone("SELECT 1"))
            except Exception as e:
                if not metrics.outages.failed("heartbeat", e):
                    log.warning("heartbeat: %s did not answer: %s", service, e)
            else:
                metrics.outages.reached(service)  # (says it is back, if it was away)
                reached += 1
        if reached == 2:
            metrics.healthy_at.set(time.time())
            try:
                degraded = await sample(core, metrics, degraded)
                await seen.beat(core, "worker", WORKER_ID, healthy=True, degraded=degraded)
            except Exception as e:
                log.debug("metrics sample skipped: %s", e)
        await asyncio.sleep(BEAT_SECONDS)


async def _every_master(core: Core) -> None:
    """Redis is reached when every master answers (on a cluster, one failing over is Redis still away)."""
    await asyncio.gather(*(client.ping() for client in core.nodes.masters().values()))


async def sample(core: Core, metrics: WorkerMetrics, said: dict[str, str] | None = None) -> dict[str, str]:
    """The backlog (entries in the 64 outboxes, waiting or being paid) and INFO of every master. Returns
    how each degraded master is degraded (``durability_degraded``); an error line says each one not in
    ``said`` (what the last sample returned)."""
    metrics.queue_depth.set((await backlog(core.redis)).total)
    last = await cast(Awaitable[dict[bytes, bytes]], core.redis.hgetall(keys.reconciled()))
    if b"at" in last:  # the last reconciliation, whichever worker ran it
        metrics.reconciled.record(int(last[b"differences"]), float(last[b"at"]))
    level = core.settings.durability
    usage = await core.nodes.usage()
    degraded: dict[str, str] = {}
    for gone in metrics.masters - usage.keys():  # a master failed over is no master any more
        for gauge in (
            metrics.redis_cpu,
            metrics.redis_memory,
            metrics.redis_replicas,
            metrics.durability_degraded,
            metrics.redis_evicting,
        ):
            gauge.remove(gone)
    metrics.masters = set(usage)
    for address, master in usage.items():
        metrics.redis_cpu.set(address, master.cpu)
        metrics.redis_memory.labels(address).set(master.memory)
        metrics.redis_replicas.labels(address).set(master.replicas)
        problem = durability_degraded(level, master)
        metrics.durability_degraded.labels(address).set(int(problem is not None))
        evicting = eviction_problem(master.eviction)
        metrics.redis_evicting.labels(address).set(int(evicting is not None))
        problem = "; ".join(p for p in (evicting, problem) if p is not None) or None
        if problem is not None:
            degraded[address] = problem
            if (said or {}).get(address) != problem:
                log.error("Redis master %s: %s", address, problem)
        elif address in (said or {}):
            log.warning("Redis master %s keeps grabs as asked again", address)
    return degraded


def webhook_tasks(core: Core, metrics: WorkerMetrics) -> list[asyncio.Task[None]]:
    """The webhook dispatcher, when any webhook endpoint is configured (``server.money.endpoints``)."""
    if not endpoints.configured(core.settings):
        return []
    return [asyncio.create_task(Dispatcher(core, metrics).run())]


@contextlib.asynccontextmanager
async def beside_hub(core: Core) -> AsyncIterator[CollectorRegistry]:
    """The whole worker in a hub's process (``redpacket up``: ``server.hub.app.create_app``'s ``beside``);
    its metrics are shown after the hub's."""
    metrics = WorkerMetrics(own_process=False)
    async with running_worker(core, metrics):
        yield metrics.registry


@contextlib.asynccontextmanager
async def running_worker(core: Core, metrics: WorkerMetrics | None = None) -> AsyncIterator[WorkerMetrics]:
    """The whole worker in this process for the duration of the block: the drain, arq, the heartbeat."""
    metrics = metrics or WorkerMetrics()
    tasks = [
        asyncio.create_task(CreditDrain(core, metrics).run()),
        asyncio.create_task(run_arq(core, metrics)),
        asyncio.create_task(heartbeat(core, metrics)),
        *webhook_tasks(core, metrics),
    ]
    try:
        yield metrics
    finally:
        await stop(tasks, "the worker")


def health(settings: Settings) -> tuple[bool, str]:
    """The health of the worker whose metrics this host serves on ``REDPACKET_WORKER_METRICS_PORT`` (in
    compose: the worker of this container), and why, in a line: healthy if its last heartbeat reached
    Redis and the database within ``HEALTHY_WITHIN`` seconds (its drain runs beside the heartbeat)."""
    url = own_url(settings.host, settings.worker_metrics_port, "/metrics")
    try:
        status, text = ask_own(url, 5)
    except OSError as e:
        return False, f"unhealthy: no worker answers on {url} ({e})"
    if status != 200:
        return False, f"unhealthy: {url} answered {status}"
    beat = re.search(r"^redpacket_worker_healthy_at_seconds (\S+)$", text, re.MULTILINE)
    at = float(beat[1]) if beat else 0.0
    if not at:
        return False, "unhealthy: the worker has not reached Redis and the database yet"
    age = time.time() - at
    ok = age < HEALTHY_WITHIN
    return ok, f"{'healthy' if ok else 'unhealthy'}: last heartbeat {age:.0f} s ago"
