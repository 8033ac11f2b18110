"""The worker process's own surface: its health line for compose, its jobs and crons."""

from __future__ import annotations

from server.cli import _worker_healthy
from server.core import Core
from worker.main import make_worker


async def test_health_check_reports_a_running_worker(core: Core) -> None:
    assert not await _worker_healthy(core.settings)
    w = make_worker(core, burst=True, poll_delay=0, cron_jobs=[])
    await w.async_run()  # a worker that ran writes its health line (and keeps it while alive)
    assert await _worker_healthy(core.settings)


async def test_arq_can_run_the_worker_settings(core: Core) -> None:
    import os

    from arq.worker import create_worker

    os.environ["REDPACKET_REDIS_URL"] = core.settings.redis_url
    os.environ["REDPACKET_DATABASE_URL"] = core.settings.database_url
    os.environ["REDPACKET_QUEUE_NAME"] = core.settings.queue_name
    try:
        import importlib

        import worker.settings

        settings_module = importlib.reload(worker.settings)
    finally:
        for k in ("REDPACKET_REDIS_URL", "REDPACKET_DATABASE_URL", "REDPACKET_QUEUE_NAME"):
            del os.environ[k]
    ws = settings_module.WorkerSettings
    assert ws.queue_name == core.settings.queue_name
    w = create_worker(ws, burst=True, poll_delay=0, cron_jobs=[], handle_signals=False)
    try:
        await w.async_run()
    finally:
        # (Worker.close() calls a redis-py method deprecated in 5.x: shut down by hand.)
        await ws.on_shutdown(w.ctx)
        await w.pool.aclose(close_connection_pool=True)
    assert {"credit_grab"} <= set(w.functions)
