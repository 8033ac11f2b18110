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
