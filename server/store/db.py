"""The database behind the ledger, one interface: MySQL/MariaDB through aiomysql (``server.store.mysql``:
one server or a Galera cluster) or SQLite through aiosqlite (``server.store.sqlite``); ``engines.connect``
opens one by URL.

SQL is written once with ``%s`` placeholders. Every dialect difference lives in ``Dialect``
(``server.store.dialect``): placeholders, row locks, DDL tokens; how a write transaction begins is each
driver's class below. Errors from either driver come out as the classes here, so callers never import a
driver.

**An unknown outcome.** A connection lost while COMMIT is in flight (the server may have committed and its
answer was lost) raises ``CommitUnknown``. ``Database.run`` runs the work again only when the caller says
it is idempotent — every money write carries an idempotency key made *before* the transaction (a unique
key decides a replay), so a second run finds the first one's rows instead of writing them again. The
re-run's ``Tx.resumed`` is true and its ``Tx.token`` is the first run's, so it can tell its own earlier
rows (journal rows carry the token) from someone else's. Work that is not idempotent gets
``OutcomeUnknown`` instead of a second run.

Cancellation: cancelling a transaction before COMMIT rolls it back (aiomysql closes the connection, which
drops the work). A cancel while COMMIT is in flight leaves the outcome unknown, as above.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import secrets
import sqlite3
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pymysql

from server.store.dialect import Dialect

log = logging.getLogger(__name__)

# The wait before a transaction runs again is drawn (full jitter) from a window of the failed attempt's
# own duration (at least BACKOFF_S, at most BACKOFF_UNIT_MAX_S: a lock wait's 50 s are no measure), doubled
# each attempt, and at most BACKOFF_MAX_S. In units of its own duration, so that conflicting writers (two
# Galera nodes certifying against each other) spread out as well on a slow machine or disk as on a fast
# one: with a fixed 5 ms window, a run whose transactions took 50 ms met its rival again in step for the
# first four attempts, and gave up after eight (1213 to the caller) on a machine half as fast.
BACKOFF_S = 0.005
BACKOFF_UNIT_MAX_S = 0.1
BACKOFF_MAX_S = 2.0


def backoff_window(attempt: int, took: float) -> float:
    """The window the wait after failed ``attempt`` (1, 2, ...) is drawn from, for an attempt that took
    ``took`` seconds."""
    unit = min(max(took, BACKOFF_S), BACKOFF_UNIT_MAX_S)
    return min(unit * (1 << attempt), BACKOFF_MAX_S)


Row = tuple[Any, ...]
Params = Sequence[Any]
T = TypeVar("T")


def as_text(value: object) -> str:
    """A key column as text: MySQL answers VARBINARY columns (the byte-exact keys) with bytes."""
    return value.decode() if isinstance(value, bytes | bytearray) else str(value)


class DatabaseError(Exception):
    pass


class IntegrityError(DatabaseError):
    """A unique or check constraint refused the write."""


class RetryableError(DatabaseError):
    """Deadlock, lock wait timeout, a certification conflict or a lost connection: the transaction was
    rolled back; run it again. ``reason``: why, as ``DatabaseHealth.retries`` counts it."""

    def __init__(self, message: str, reason: str = "other") -> None:
        super().__init__(message)
        self.reason = reason


class Unreachable(RetryableError):
    """No connection could be made (the server down, unreachable or full; of a cluster, no node that can
    take writes): nothing was sent. Retryable, but not at once — ``Database.run`` does not run it again;
    its caller answers that the database is unavailable, and the client, cron or drain tries later."""

    def __init__(self, message: str) -> None:
        super().__init__(message, reason="unreachable")


class NotReady(Unreachable):
    """No node can take writes now, but one answered and is not ready: a Galera cluster settling (a node
    being dropped, the rest forming their primary component again, or one catching up), which is usually
    over within seconds. Handled as ``Unreachable`` everywhere, but a process starting waits for it
    (``engines.when_ready``) instead of taking it for an operator's mistake."""


class CommitUnknown(RetryableError):
    """The connection was lost while COMMIT was in flight: the transaction may or may not have committed.
    Safe to run again only if the work is idempotent (``Database.run(..., idempotent=True)``)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, reason="commit_unknown")


class OutcomeUnknown(DatabaseError):
    """Work that is not idempotent lost its COMMIT answer: it may have been done. Not run again; the
    caller (or its client) looks before retrying."""


@dataclass
class DatabaseHealth:
    """What a process's database went through, for its metrics: transactions run again, by reason
    (``deadlock`` — on Galera also a certification conflict —, ``lock_wait``, ``node_not_ready``,
    ``connection``, ``timeout``, ``busy``, ``failover``, ``commit_unknown``, ``shard``: a Spider head's
    backend away), and moves to another node.
    (The node it writes to is ``Database.writer``.)"""

    retries: collections.Counter[str] = field(default_factory=collections.Counter)
    failovers: int = 0


class Tx:
    """One open transaction. Obtained from ``Database.transaction()``; never kept past it.

    ``token``: a random number of the ``Database.run`` call, the same in each of its runs, written into
    the journal rows it posts (and naming a credit batch's event row: ``server.money.events``).
    ``resumed``: an earlier run of this call lost its COMMIT answer, so rows carrying ``token`` may
    already be there.
    """

    def __init__(self, dialect: Dialect, cursor: Any) -> None:
        self.dialect = dialect
        self._cur = cursor
        self.lastrowid: int | None = None
        self.token: int = secrets.randbits(63)
        self.resumed = False

    async def _run(self, step: Awaitable[T]) -> T:
        """One call to the driver (bounded in time where the driver has no timeout of its own)."""
        return await step

    async def _send(self, statement: str, params: Params) -> None:
        """One statement and its values to the driver (MySQL's transaction writes the values itself)."""
        await self._run(self._cur.execute(self.dialect.sql(statement), tuple(params)))

    async def _send_many(self, statement: str, rows: Sequence[Params]) -> int:
        await self._run(self._cur.executemany(self.dialect.sql(statement), [tuple(r) for r in rows]))
        return int(self._cur.rowcount)

    async def execute(self, statement: str, params: Params = ()) -> int:
        """Run one statement; return the number of rows it changed."""
        try:
            await self._send(statement, params)
        except (pymysql.err.IntegrityError, sqlite3.IntegrityError) as e:
            raise IntegrityError(str(e)) from e
        self.lastrowid = self._cur.lastrowid
        return int(self._cur.rowcount)

    async def executemany(self, statement: str, rows: Sequence[Params]) -> int:
        """Insert many rows. On MySQL ``INSERT ... VALUES (%s, ...)`` becomes one multi-row INSERT."""
        if not rows:
            return 0
        try:
            return await self._send_many(statement, rows)
        except (pymysql.err.IntegrityError, sqlite3.IntegrityError) as e:
            raise IntegrityError(str(e)) from e

    async def fetchone(self, statement: str, params: Params = ()) -> Row | None:
        await self._send(statement, params)
        row: Any = await self._cur.fetchone()
        return None if row is None else tuple(row)

    async def fetchall(self, statement: str, params: Params = ()) -> list[Row]:
        await self._send(statement, params)
        rows: Any = await self._cur.fetchall()
        return [tuple(r) for r in rows]


class Database:
    """A pool of connections to one database; use as an async context manager."""

    dialect: Dialect
    # How many backends a sharded ledger (a MariaDB Spider head) spreads the money over; 0: one database,
    # where one transaction may write any rows (``server.store.shards``). Set by ``engines.connect``.
    shards: int = 0

    def __init__(self) -> None:
        self.health = DatabaseHealth()

    @property
    def writer(self) -> str:
        """The server (of a cluster, the node) this process writes to and reads from."""
        return ""

    async def reset_writer(self) -> str:
        """Go back to the first node of the URL that can take writes (one server: nothing to do)."""
        return self.writer

    def transaction(self) -> AbstractAsyncContextManager[Tx]:
        """A transaction: committed when the block ends, rolled back if it raises or is cancelled."""
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError

    def connections_in_use(self) -> int:
        """Connections (or, on SQLite, the writer's lock) held by a transaction or a read right now."""
        raise NotImplementedError

    def snapshot(self) -> AbstractAsyncContextManager[Tx]:
        """Reads that all see one consistent state of the database, whatever commits meanwhile, and
        block no writer (the reconciliation: its figures must add up while money moves)."""
        return self.transaction()

    async def run(self, work: Callable[[Tx], Awaitable[T]], *, idempotent: bool, attempts: int = 8) -> T:
        """Run ``work`` in a transaction, again from the start after a deadlock or a lost connection (not
        when no connection can be made: ``Unreachable``, raised at once).

        ``idempotent``: whether running ``work`` again after its COMMIT answer was lost is safe (its
        writes are keyed, so a second run finds the first one's). If not, a lost COMMIT answer raises
        ``OutcomeUnknown`` and ``work`` is not run again."""
        token = secrets.randbits(63)
        resumed = False
        loop = asyncio.get_running_loop()
        for attempt in range(1, attempts + 1):
            began = loop.time()
            try:
                async with self.transaction() as tx:
                    tx.token, tx.resumed = token, resumed
                    return await work(tx)
            except CommitUnknown as e:
                self.health.retries[e.reason] += 1
                if not idempotent:
                    raise OutcomeUnknown(
                        f"the connection was lost while committing: the change may or may not be made ({e})"
                    ) from e
                resumed = True
                if attempt == attempts:
                    raise
                log.warning("transaction's COMMIT answer lost: run again, keyed (attempt %d)", attempt)
            except RetryableError as e:
                if attempt == attempts or isinstance(e, Unreachable):
                    raise
                self.health.retries[e.reason] += 1
                # (counted: redpacket_db_retries; a line each would be dozens in an outage, which the
                # process says once as it starts and once as it ends)
                log.debug("transaction retried after %s (attempt %d): %s", e.reason, attempt, e)
                # Exponential back-off with full jitter: conflicting writers do not meet again in step.
                await asyncio.sleep(random.uniform(0, backoff_window(attempt, loop.time() - began)))
        raise AssertionError("unreachable")

    async def fetchone(self, statement: str, params: Params = ()) -> Row | None:
        """One read outside any transaction: sees what is committed."""
        rows = await self._read(statement, params)
        return rows[0] if rows else None

    async def fetchall(self, statement: str, params: Params = ()) -> list[Row]:
        return await self._read(statement, params)

    async def _read(self, statement: str, params: Params) -> list[Row]:
        """A lone read, in a transaction of its own unless the engine does better (both do)."""
        async with self.transaction() as tx:
            return await tx.fetchall(statement, params)

    async def __aenter__(self) -> Database:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
