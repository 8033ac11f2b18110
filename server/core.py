"""The handles every operation needs, opened once per process and passed down."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from arq.connections import ArqRedis
from redis.exceptions import ClusterDownError, ReadOnlyError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from server import errors, schema
from server.batch import Batcher
from server.db import Database, DatabaseError, connect
from server.errors import Unavailable
from server.membership import Membership
from server.queue import make_redis
from server.scripts import Scripts
from server.settings import Settings
from server.split import Limits

# Redis is down, restarting, loading its data (BusyLoadingError is a ConnectionError), or failing over
# (a replica refusing writes, a cluster without a primary). Any other Redis error is a bug.
REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, ReadOnlyError, TryAgainError, ClusterDownError)


def unavailable(e: BaseException) -> Unavailable | None:
    """The error a client gets when ``e`` means a backing service is down (Redis unreachable, restarting
    or loading its data; the database unreachable or its connection lost): retry later. None for any
    other exception, which is a bug."""
    if isinstance(e, Unavailable):
        return e
    if isinstance(e, REDIS_DOWN):
        return Unavailable(errors.REDIS_UNAVAILABLE, f"Redis is unavailable: {e}")
    if isinstance(e, DatabaseError):
        return Unavailable(errors.DATABASE_UNAVAILABLE, f"the database is unavailable: {e}")
    return None


@dataclass
class Core:
    settings: Settings
    db: Database
    redis: ArqRedis
    scripts: Scripts
    membership: Membership
    # The OS CSPRNG in production; tests pass a seeded random.Random.
    rng: random.Random = field(default_factory=random.SystemRandom)
    # Coalesces the grab path's Redis calls of one loop tick into one pipeline; None sends each alone.
    batcher: Batcher | None = None

    @property
    def limits(self) -> Limits:
        s = self.settings
        return Limits(s.max_count, s.max_total_cents, s.max_greeting_chars)


@asynccontextmanager
async def open_core(
    settings: Settings, rng: random.Random | None = None, migrate: bool = True
) -> AsyncIterator[Core]:
    """Connect to the database and Redis named by ``settings``; close both on exit."""
    db = await connect(settings.effective_database_url, settings.db_pool_size)
    redis = make_redis(settings)
    try:
        if migrate:
            await schema.migrate(db)
        scripts = Scripts(redis)
        batcher = Batcher(redis) if settings.batch_redis else None
        yield Core(
            settings=settings,
            db=db,
            redis=redis,
            scripts=scripts,
            membership=Membership(db, redis, scripts, settings.membership_cache_seconds, batcher),
            rng=rng or random.SystemRandom(),
            batcher=batcher,
        )
    finally:
        await redis.aclose(close_connection_pool=True)
        await db.close()
