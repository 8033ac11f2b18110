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
from server.core import queue_name as deployment_queue
from server.settings import EMBEDDED, Settings
from server.stopping import stop
from server.store.engines import connect
from server.store.queue import job_deserializer, job_serializer
from server.store.schema import deployment_id, migrate
from worker.drain import CreditDrain
from worker.main import cron_jobs, heartbeat, webhook_tasks
from worker.metrics import WorkerMetrics

_settings = Settings.from_env()


async def _namespace() -> str:
    db = await connect(_settings.effective_database_url, 1, _settings.db_statement_timeout_ms / 1000)
    try:
        await migrate(db)
        return await deployment_id(db)
    finally:
        await db.close()


# The queue and the crons' names hold the deployment's namespace, which the database holds: read now
# (arq reads this class before it starts its loop).
_namespace_now = asyncio.run(_namespace())


async def _startup(ctx: dict[str, Any]) -> None:
    stack = AsyncExitStack()
    core = await stack.enter_async_context(open_core(_settings))
    metrics = WorkerMetrics()
    tasks = [
        asyncio.create_task(CreditDrain(core, metrics).run()),
        asyncio.create_task(heartbeat(core, metrics)),
        *webhook_tasks(core, metrics),
    ]
    ctx.update(core=core, metrics=metrics, stack=stack, tasks=tasks)


async def _shutdown(ctx: dict[str, Any]) -> None:
    await stop(ctx["tasks"], "the worker")
    await ctx["stack"].aclose()


def _arq_redis_url(settings: Settings) -> str:
    """arq's command connects by itself: to the URL named (the embedded Valkey is `redpacket worker`'s)."""
    if settings.redis_url == EMBEDDED:
        raise ValueError(
            "REDPACKET_REDIS_URL=embedded is for `redpacket worker`: arq's own command needs a Redis URL"
        )
    return settings.redis_url or "redis://127.0.0.1:6379/0"


class WorkerSettings:
    functions: ClassVar[list[Any]] = []
    cron_jobs = cron_jobs(_namespace_now)
    queue_name = deployment_queue(_settings, _namespace_now)
    redis_settings = RedisSettings.from_dsn(_arq_redis_url(_settings))
    job_serializer = staticmethod(job_serializer)
    job_deserializer = staticmethod(job_deserializer)
    on_startup = _startup
    on_shutdown = _shutdown
    health_check_interval = 60
    ctx: ClassVar[dict[str, Any]] = {}
