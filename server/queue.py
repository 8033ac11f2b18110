"""The Redis client shared by the hub and the workers, which is also arq's connection for its queue.

One bounded pool (a burst of grabs waits for a connection instead of opening thousands), msgpack for
arq's jobs (the periodic ones; credits have their own queue, ``worker.drain``).
"""

from __future__ import annotations

from typing import Any

import hiredis
import msgpack
from arq.connections import ArqRedis
from redis.asyncio import BlockingConnectionPool
from redis.asyncio.connection import Connection

from server.settings import Settings


def job_serializer(obj: dict[str, Any]) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]


def job_deserializer(data: bytes) -> dict[str, Any]:
    return msgpack.unpackb(data, raw=False)  # type: ignore[no-any-return]


class PackedConnection(Connection):
    """A Redis connection that packs commands with hiredis (C) instead of redis-py 5.3's asyncio
    packer (Python): under a grab storm that packer was a third of the hub's time. Same bytes on the
    wire; multi-word command names ("SCRIPT LOAD") are split as redis-py does."""

    def pack_command(self, *args: Any) -> list[bytes]:
        head = args[0]
        if isinstance(head, str) and " " in head:
            args = (*head.split(), *args[1:])
        elif isinstance(head, bytes) and b" " in head:
            args = (*head.split(), *args[1:])
        return [hiredis.pack_command(args)]


def make_redis(settings: Settings) -> ArqRedis:
    """A client for ``settings.redis_url`` that also enqueues arq jobs. Opens no connection yet."""
    if not settings.redis_url:
        raise ValueError("no Redis URL: start the embedded Valkey first (see server.embedded)")
    pool = BlockingConnectionPool.from_url(
        settings.redis_url,
        max_connections=settings.redis_pool_size,
        timeout=10,
        # A Redis that is down refuses at once; one that is unreachable must not hang a request for
        # the OS's minutes-long connect timeout.
        socket_connect_timeout=5,
        connection_class=PackedConnection,
    )
    return ArqRedis(
        pool_or_conn=pool,
        job_serializer=job_serializer,
        job_deserializer=job_deserializer,
        default_queue_name=settings.queue_name,
    )
