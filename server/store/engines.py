"""Open the ledger's database named by a URL: MySQL/MariaDB (one server, a Galera cluster's nodes, or
the head of a sharded ledger on MariaDB Spider) or SQLite."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from server.store import shards
from server.store.db import Database, DatabaseError, NotReady, RetryableError, Unreachable
from server.store.mysql import MySQLDatabase
from server.store.sqlite import SQLiteDatabase

log = logging.getLogger(__name__)
T = TypeVar("T")

# How long a process starting waits for a database that answers "not now" (a Galera cluster dropping a
# node and forming its primary component again: seconds, 15-20 s with Galera's default timeouts). A
# database that is down, refuses the user or lacks the database is not waited for.
READY_WITHIN_SECONDS = 60.0


async def connect(url: str, pool_size: int = 10, statement_timeout: float = 10.0) -> Database:
    """Open the database named by ``url``: ``mysql://user:pass@host:port,host:port/db`` (one server, or
    the nodes of a Galera cluster: ``server.store.mysql``) or ``sqlite:///path``. ``statement_timeout``:
    how long a MySQL statement may take before its node is looked at again (seconds)."""
    scheme = url.split(":", 1)[0]
    if scheme in ("mysql", "mariadb", "mysql+aiomysql"):
        db = await MySQLDatabase.connect(url, pool_size, statement_timeout)
        try:
            db.shards = await shards.count(db)  # the head's own table definitions say (a Spider head)
        except BaseException:
            await db.close()
            raise
        return db
    if scheme == "sqlite":
        return await SQLiteDatabase.connect(url[len("sqlite:///") :] or ":memory:")
    raise ValueError(f"unsupported database URL scheme {scheme!r}: use mysql:// or sqlite:///")


def settling(e: BaseException) -> bool:
    """Whether ``e`` is a database's "not now" rather than "no": a cluster settling (``NotReady``), or a
    transaction rolled back to be run again (a lock wait, a deadlock, a certification conflict, a move
    to another node) — not a database that is down (``Unreachable``) or a mistake in the URL."""
    if isinstance(e, NotReady):
        return True
    return isinstance(e, RetryableError) and not isinstance(e, Unreachable)


async def when_ready(attempt: Callable[[], Awaitable[T]], within: float = READY_WITHIN_SECONDS) -> T:
    """``attempt()`` (a process's first steps on its database), again after a short wait for as long as it
    fails with ``settling`` errors, up to ``within`` seconds: a process started while a node is lost comes
    up once the cluster has settled, instead of exiting (under a supervisor that does not restart it, for
    good). Any other error, and a settling one past ``within``, is raised."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    waits = 0
    while True:
        try:
            return await attempt()
        except DatabaseError as e:
            if not settling(e):
                raise
            if loop.time() >= deadline:
                raise DatabaseError(f"not ready within {within:g} s: {e}") from e
            waits += 1
            log.warning("the database is not ready (%s): trying again", e)
            await asyncio.sleep(min(0.1 * 2**waits, 2.0, max(0.0, deadline - loop.time())))
