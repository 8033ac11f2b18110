"""``WorkerSettings`` for running the jobs with arq's own command:

    arq worker.settings.WorkerSettings

``redpacket worker`` is the documented start command (it adds the bulk credit drain and the metrics
port); this class is for operators who run arq directly. The settings object is built from the
environment when arq imports this module — its start-up; no connection is opened before on_startup.
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from typing import Any, ClassVar

from arq.connections import RedisSettings

from server.core import open_core
from server.queue import job_deserializer, job_serializer
from server.settings import Settings
from worker.credit import CreditBatcher
from worker.main import KEEP_RESULT_SECONDS, job_functions
from worker.metrics import WorkerMetrics

_settings = Settings.from_env()


async def _startup(ctx: dict[str, Any]) -> None:
    stack = AsyncExitStack()
    core = await stack.enter_async_context(open_core(_settings))
    metrics = WorkerMetrics()
    ctx.update(core=core, metrics=metrics, batcher=CreditBatcher(core.db, metrics), stack=stack)


async def _shutdown(ctx: dict[str, Any]) -> None:
    await ctx["stack"].aclose()


class WorkerSettings:
    functions, cron_jobs = job_functions()
    queue_name = _settings.queue_name
    redis_settings = RedisSettings.from_dsn(_settings.redis_url or "redis://127.0.0.1:6379/0")
    job_serializer = staticmethod(job_serializer)
    job_deserializer = staticmethod(job_deserializer)
    keep_result = KEEP_RESULT_SECONDS
    on_startup = _startup
    on_shutdown = _shutdown
    health_check_interval = 60
    max_jobs = 50
    ctx: ClassVar[dict[str, Any]] = {}
