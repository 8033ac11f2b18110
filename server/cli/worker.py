"""``redpacket worker``: the worker process, and ``worker --check``, its health as a container asks."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator

from server import tracing
from server.cli.errors import OperatorError
from server.cli.services import check_services
from server.core import open_core, reset_writer_when_told
from server.settings import Settings
from server.stopping import STOP_SECONDS, say_where_stuck

log = logging.getLogger("redpacket")


async def run_worker(settings: Settings) -> None:
    from prometheus_client import start_http_server

    from worker.main import collecting_as_a_worker, running_worker
    from worker.metrics import WorkerMetrics

    await check_services(settings)
    tracing.configure("redpacket-worker")
    async with open_core(settings) as core, _flushing_traces():
        metrics = WorkerMetrics()
        metrics.database.watch(core.db)
        if settings.worker_metrics_port:
            try:
                start_http_server(settings.worker_metrics_port, addr=settings.host, registry=metrics.registry)
            except OSError as e:
                raise OperatorError(
                    f"cannot serve worker metrics on {settings.host}:{settings.worker_metrics_port}:"
                    f" {e.strerror} (set REDPACKET_WORKER_METRICS_PORT, 0 for none)"
                ) from None
        stop = asyncio.Event()

        def stopping() -> None:
            if not stop.is_set():  # a stop that hangs says where and ends the process (server.stopping)
                # (At least twice the tasks' own stop bound: a stop that only reaches it still ends cleanly.)
                say_where_stuck(max(settings.shutdown_seconds, 2 * STOP_SECONDS), then_exit=True)
            stop.set()

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stopping)
        reset_writer_when_told(core)
        # SIGINT/SIGTERM: the drain gives back the claims of a batch not yet paid (or they lapse), arq's
        # running jobs are cancelled (each is idempotent and runs again later); then the process exits.
        with collecting_as_a_worker():
            async with running_worker(core, metrics):
                log.info("worker running; metrics on port %s", settings.worker_metrics_port or "(off)")
                await stop.wait()


@contextlib.asynccontextmanager
async def _flushing_traces() -> AsyncIterator[None]:
    """The spans still buffered are sent on the way out (the SDK bounds it: ``OTEL_BSP_EXPORT_TIMEOUT``)."""
    try:
        yield
    finally:
        await asyncio.to_thread(tracing.shutdown)


def worker_healthy(settings: Settings) -> bool:
    """``worker --check``: the health of the worker whose metrics this host serves, said in one line."""
    from worker.main import health

    if not settings.worker_metrics_port:
        raise OperatorError(
            "worker --check reads the worker's metrics: REDPACKET_WORKER_METRICS_PORT is 0", 2
        )
    ok, said = health(settings)
    print(said)
    return ok
