"""``WorkerSettings`` for running the worker with arq's own command:

    arq worker.settings.WorkerSettings

``redpacket worker`` is the documented start command: it also serves metrics and rides out Redis
outages on its own (arq's command exits on the first Redis error; run it under a supervisor). Here arq
runs the periodic jobs and, from its start-up hook, the credit drain and the heartbeat. The settings
object is built from the environment when arq imports this module — its start-up; no connection is
opened before on_startup.
"""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from typing import Any, ClassVar

from arq.connections import RedisSettings

from server.core import open_core
from server.settings import Settings
from server.store.queue import job_deserializer, job_serializer
from worker.drain import CreditDrain
from worker.main import cron_jobs, heartbeat
from worker.metrics import WorkerMetrics

_settings = Settings.from_env()


async def _startup(ctx: dict[str, Any]) -> None:
    stack = AsyncExitStack()
    core = await stack.enter_async_context(open_core(_settings))
    metrics = WorkerMetrics()
    tasks = [
        asyncio.create_task(CreditDrain(core, metrics).run()),
        asyncio.create_task(heartbeat(core, metrics)),
    ]
    ctx.update(core=core, metrics=metrics, stack=stack, tasks=tasks)


async def _shutdown(ctx: dict[str, Any]) -> None:
    for task in ctx["tasks"]:
        task.cancel()
    await asyncio.gather(*ctx["tasks"], return_exceptions=True)
    await ctx["stack"].aclose()


class WorkerSettings:
    functions: ClassVar[list[Any]] = []
    cron_jobs = cron_jobs()
    queue_name = _settings.queue_name
    redis_settings = RedisSettings.from_dsn(_settings.redis_url or "redis://127.0.0.1:6379/0")
    job_serializer = staticmethod(job_serializer)
    job_deserializer = staticmethod(job_deserializer)
    on_startup = _startup
    on_shutdown = _shutdown
    health_check_interval = 60
    ctx: ClassVar[dict[str, Any]] = {}
