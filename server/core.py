"""The handles every operation needs, opened once per process and passed down."""

from __future__ import annotations

import asyncio
import logging
import random
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from arq.connections import ArqRedis
from redis.asyncio import Redis
from redis.exceptions import (
    ClusterDownError,
    ReadOnlyError,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from server import errors
from server.errors import Unavailable
from server.money.membership import Membership
from server.money.split import Limits
from server.settings import Settings
from server.store import keys, schema
from server.store.batch import Batcher
from server.store.db import Database, DatabaseError, OutcomeUnknown, RetryableError
from server.store.engines import connect, when_ready
from server.store.queue import make_queue
from server.store.redisnodes import RedisNodes, moved
from server.store.repair import Repairs
from server.store.scripts import Scripts

log = logging.getLogger(__name__)

# Redis is down, restarting, loading its data (BusyLoadingError is a ConnectionError), or failing over
# (a replica refusing writes, a cluster without a primary, a slot the client knows no master of). Any other
# Redis error is a bug.
REDIS_DOWN = (
    RedisConnectionError,
    RedisTimeoutError,
    ReadOnlyError,
    TryAgainError,
    ClusterDownError,
    SlotNotCoveredError,
)


def unavailable(e: BaseException) -> Unavailable | None:
    """The error a client gets when ``e`` means a backing service is down (Redis unreachable, restarting
    or loading its data; the database unreachable or its connection lost): retry later. None for any
    other exception, which is a bug."""
    if isinstance(e, Unavailable):
        return e
    if isinstance(e, REDIS_DOWN) or (isinstance(e, ResponseError) and moved(e)):
        return Unavailable(errors.REDIS_UNAVAILABLE, f"Redis is unavailable: {e}")
    if isinstance(e, DatabaseError):
        return Unavailable(errors.DATABASE_UNAVAILABLE, f"the database is unavailable: {e}")
    return None


def transient(e: BaseException) -> bool:
    """Whether background work that failed with ``e`` met a service away (Redis down or failing over, the
    database unreachable or its connection lost, an outcome left unknown by it) and is tried again later:
    a warning line. Anything else — a database error that is an answer (a bad statement, a constraint)
    included — is a bug, with its traceback."""
    if isinstance(e, DatabaseError):
        return isinstance(e, RetryableError | OutcomeUnknown)
    return unavailable(e) is not None


@dataclass
class Core:
    settings: Settings
    # What this deployment's Redis keys and arq queue are named under (server.store.keys).
    namespace: str
    db: Database
    nodes: RedisNodes
    # arq's queue server (the main Redis unless that is a cluster).
    queue: ArqRedis
    scripts: Scripts
    membership: Membership
    # Sends the Redis calls of one loop tick as one pipeline per master, waiting for durability.
    batcher: Batcher
    # Which packets were checked against the database since Redis last restarted or failed over.
    repairs: Repairs
    # The OS CSPRNG in production; tests pass a seeded random.Random.
    rng: random.Random = field(default_factory=random.SystemRandom)

    @property
    def queue_name(self) -> str:
        return queue_name(self.settings, self.namespace)

    @property
    def redis(self) -> Redis:
        """The client for keyed commands and pipelines (routed by slot on a cluster)."""
        return self.nodes.client

    @property
    def limits(self) -> Limits:
        s = self.settings
        return Limits(s.max_count, s.max_total_cents, s.max_greeting_chars)


async def _open_ledger(settings: Settings, migrate: bool) -> tuple[Database, str]:
    """The database, migrated if asked (if not, one behind the code is ``schema.SchemaBehind``), and the
    deployment's id (the one place it is decided: every process reads it)."""
    db = await connect(
        settings.effective_database_url, settings.db_pool_size, settings.db_statement_timeout_ms / 1000
    )
    try:
        if migrate:
            await schema.migrate(db)
        elif missing := await schema.pending(db):
            raise schema.SchemaBehind(missing)
        return db, await schema.deployment_id(db)
    except BaseException:
        await db.close()
        raise


@asynccontextmanager
async def open_core(
    settings: Settings, rng: random.Random | None = None, migrate: bool = True
) -> AsyncIterator[Core]:
    """Connect to the database, Redis (one server or a cluster) and arq's queue server named by
    ``settings``; close them all on exit."""
    if settings.embedded_redis:
        raise ValueError("no Redis URL: start the embedded Valkey first (see server.store.embedded)")
    db, namespace = await when_ready(lambda: _open_ledger(settings, migrate))
    nodes = RedisNodes(settings.redis_url, settings.redis_pool_size, settings.redis_command_seconds)
    queue: ArqRedis | None = None
    claimed = False
    try:
        keys.claim(namespace)
        claimed = True
        queue = make_queue(settings, queue_name(settings, namespace))
        await nodes.open()
        scripts = Scripts(nodes.client)
        batcher = Batcher(
            nodes,
            settings.durability,
            settings.durability_timeout_ms,
            max_batch=512 if settings.batch_redis else 1,
        )
        yield Core(
            settings=settings,
            namespace=namespace,
            db=db,
            nodes=nodes,
            queue=queue,
            scripts=scripts,
            membership=Membership(db, nodes.client, scripts, settings.membership_cache_seconds, batcher),
            batcher=batcher,
            repairs=Repairs(nodes),
            rng=rng or random.SystemRandom(),
        )
    finally:
        if claimed:
            keys.release()
        if queue is not None:
            await queue.aclose(close_connection_pool=True)
        await nodes.aclose()
        await db.close()


def queue_name(settings: Settings, namespace: str) -> str:
    """arq's queue of this deployment: ``REDPACKET_QUEUE_NAME`` within its namespace."""
    return f"{settings.queue_name}:{namespace}" if namespace else settings.queue_name


def _said_writer(task: asyncio.Task[str]) -> None:
    if task.cancelled():
        return
    if task.exception() is not None:
        log.error("told to reset the database writer, and could not: %s", task.exception())
    else:
        log.warning("told to reset the database writer: now %s", task.result())


def reset_writer_when_told(core: Core) -> None:
    """``kill -USR1`` this process: its database goes back to the first node of the URL that can take
    writes (after a failover the process stays on the node it moved to until told). For a process's own
    loop (``redpacket serve``, ``worker``): the handler lasts as long as the loop."""
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[str]] = set()

    def told() -> None:
        task = loop.create_task(core.db.reset_writer())
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        task.add_done_callback(_said_writer)

    loop.add_signal_handler(signal.SIGUSR1, told)
