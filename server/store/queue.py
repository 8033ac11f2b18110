"""arq's queue (the periodic jobs): one Redis server, the main one unless ``REDPACKET_QUEUE_REDIS_URL``
names another (required when the main one is a cluster: arq uses MULTI across its keys). msgpack for
its jobs."""

from __future__ import annotations

import math
from typing import Any

import msgpack
from arq.connections import ArqRedis

from server.settings import Settings
from server.store.redisconn import packed_pool


def job_serializer(obj: dict[str, Any]) -> bytes:
    return msgpack.packb(obj, use_bin_type=True, default=_failure_text)


def _failure_text(value: object) -> str:
    """A failed job's result is the exception it raised (arq keeps it with the job): kept as its repr, so
    that arq does not log a traceback for a result msgpack cannot hold. Anything else is a mistake."""
    if isinstance(value, BaseException):
        return repr(value)
    raise TypeError(f"a job's data holds {type(value).__name__}, which the queue does not carry")


def job_deserializer(data: bytes) -> dict[str, Any]:
    # (arq's jobs are maps: msgpack decodes whatever was packed, typed Any.)
    return msgpack.unpackb(data, raw=False)  # type: ignore[no-any-return]


def make_queue(settings: Settings, queue_name: str) -> ArqRedis:
    """A client of arq's queue server, on the queue named so. Opens no connection yet."""
    if not settings.queue_url:
        raise ValueError("no Redis URL: start the embedded Valkey first (see server.store.embedded)")
    bound = settings.redis_command_seconds  # (arq reads nothing that blocks: every command is bounded)
    pool = packed_pool(
        settings.queue_url,
        max_connections=16,
        timeout=math.ceil(bound),
        socket_connect_timeout=bound,
        socket_timeout=bound,
    )
    return ArqRedis(
        pool_or_conn=pool,
        job_serializer=job_serializer,
        job_deserializer=job_deserializer,
        default_queue_name=queue_name,
    )
