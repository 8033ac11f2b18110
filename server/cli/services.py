"""The backing services of every command: the Redis URL (the configured one, or the data directory's
embedded Valkey), and the start-up check that the database and Redis answer and can make grabs as
durable as the settings ask."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator

from redis.asyncio import Redis
from redis.exceptions import RedisClusterException, RedisError

from server.cli.errors import OperatorError
from server.settings import Settings, redact
from server.store.batch import durability_problem
from server.store.db import DatabaseError
from server.store.embedded import EmbeddedError, embedded_valkey
from server.store.identities import eviction_problem
from server.store.redisnodes import RedisNodes

log = logging.getLogger("redpacket")

# A backing service that does not answer within this long at start-up is reported, not waited on.
STARTUP_CHECK_SECONDS = 5.0


@contextlib.contextmanager
def with_redis_url(settings: Settings, command: str) -> Iterator[Settings]:
    """The settings with a Redis URL: the configured one, or the data directory's embedded Valkey (the
    one a running ``redpacket`` process serves, or one started now)."""
    if not settings.embedded_redis:
        yield settings
        return
    # The embedded Valkey makes grabs durable on its disk unless told otherwise: appendfsync always
    # (the event loop fsyncs all of one iteration's writes at once), and every grab waits for it.
    durability = settings.durability  # (Settings resolves the embedded default: aof)
    fsync = "always" if durability.fsyncs else "everysec"
    try:
        with embedded_valkey(
            settings.data_dir,
            settings.embedded_redis_port,
            exclusive=command == "up",
            owner=command,
            fsync=fsync,
        ) as url:
            yield settings.replace(redis_url=url)  # (the copy keeps the durability resolved: aof)
    except EmbeddedError as e:
        raise OperatorError(str(e)) from None


async def check_services(settings: Settings, redis_too: bool = True, durability: bool = True) -> None:
    """Fail fast, in one line, if the database or Redis does not answer (or, with ``durability``, cannot
    make grabs as durable as the settings ask)."""
    await _check_database(settings)
    if not redis_too:
        return
    nodes = RedisNodes(settings.redis_url, 4)
    try:
        await asyncio.wait_for(nodes.open(), STARTUP_CHECK_SECONDS + 1)
        masters = nodes.masters().items()
    except RedisClusterException as e:  # (not a RedisError)
        raise OperatorError(
            f"Redis at {redact(settings.redis_url)} is not a cluster, or no node of it answers: {e}"
            " (check REDPACKET_REDIS_URL: redis+cluster:// is for a Redis Cluster, redis:// for one server)"
        ) from None
    except (RedisError, OSError, TimeoutError) as e:
        raise OperatorError(
            f"Redis at {redact(settings.redis_url)} does not answer: {e or 'timed out'}"
            " (check REDPACKET_REDIS_URL)"
        ) from None
    try:
        for name, policy in nodes.identities.evicting().items() if durability else ():
            # (read as each master was met: its first connection's INFO)
            raise OperatorError(f"Redis at {name} cannot keep grabs: {eviction_problem(policy)}")
        for name, client in masters if durability else ():
            try:
                await asyncio.wait_for(_check_durability(settings, name, client), STARTUP_CHECK_SECONDS)
            except (RedisError, OSError, TimeoutError) as e:
                raise OperatorError(f"Redis at {name} does not answer: {e or 'timed out'}") from None
        if durability and settings.durability.fsyncs:
            await _check_replicas(settings, nodes)
    finally:
        await nodes.aclose()
    if settings.queue_url != settings.redis_url:
        await _check_queue(settings)


async def _check_database(settings: Settings) -> None:
    from server.store.engines import connect, when_ready
    from server.store.mysqlkit import PROBE_SECONDS, parse_url

    url = settings.effective_database_url
    # Each node of a cluster may be looked at in turn (a paused one for up to PROBE_SECONDS).
    nodes = len(parse_url(url).hosts) if url.startswith(("mysql", "mariadb")) else 1

    async def attempt() -> None:
        try:
            db = await asyncio.wait_for(
                connect(url, 1, settings.db_statement_timeout_ms / 1000),
                STARTUP_CHECK_SECONDS + (nodes - 1) * PROBE_SECONDS,
            )
        except TimeoutError:
            raise OperatorError(
                f"the database at {redact(settings.effective_database_url)} does not answer (timed out)"
                " (check REDPACKET_DATABASE_URL)"
            ) from None
        await db.close()

    try:
        await when_ready(attempt)  # a cluster settling (a node lost as this starts) is waited for
    except DatabaseError as e:  # it says what is wrong: no such database, a refused user, no server
        raise OperatorError(f"{e} (check REDPACKET_DATABASE_URL)") from None


async def _check_queue(settings: Settings) -> None:
    """arq's queue, when it has a Redis of its own."""
    q = Redis.from_url(settings.queue_url, socket_connect_timeout=STARTUP_CHECK_SECONDS, socket_timeout=5)
    try:
        await asyncio.wait_for(q.ping(), STARTUP_CHECK_SECONDS + 1)
    except (RedisError, OSError, TimeoutError) as e:
        raise OperatorError(
            f"arq's queue Redis at {redact(settings.queue_url)} does not answer: {e or 'timed out'}"
            " (check REDPACKET_QUEUE_REDIS_URL)"
        ) from None
    finally:
        await q.aclose()


async def _check_replicas(settings: Settings, nodes: RedisNodes) -> None:
    """A cluster's replicas fsync as their masters must (each is its master one day); one that cannot be
    read now is a warning line, not a reason to stay down too."""
    try:
        replicas = await asyncio.wait_for(nodes.replicas_known(), STARTUP_CHECK_SECONDS)
    except (RedisError, OSError, TimeoutError) as e:  # (an ACL refusing CLUSTER NODES, say)
        log.warning("the cluster's replicas not checked (%s): each must fsync as its master does", e)
        return
    for name, client in replicas.items():
        try:
            await asyncio.wait_for(
                _check_durability(settings, name, client, replica=True), STARTUP_CHECK_SECONDS
            )
        except (RedisError, OSError, TimeoutError) as e:
            log.warning("Redis replica at %s not checked (%s): it must fsync as its master does", name, e)


async def _check_durability(settings: Settings, name: str, client: Redis, replica: bool = False) -> None:
    """Refuse to start when grabs cannot be made as durable as REDPACKET_GRAB_DURABILITY asks."""
    problem = await durability_problem(client, settings.durability, replica)
    if problem is not None:
        raise OperatorError(
            f"REDPACKET_GRAB_DURABILITY={settings.durability} cannot be had on Redis at {name}: {problem}"
            " (configure the server so, or choose another durability)"
        )
