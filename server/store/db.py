"""The database behind the ledger: MySQL/MariaDB through aiomysql, or SQLite through aiosqlite.

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
import logging
import secrets
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import unquote, urlparse

import aiomysql
import aiosqlite
import pymysql

from server.store.dialect import MYSQL, SQLITE, Dialect

log = logging.getLogger(__name__)

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
    """Deadlock, lock wait timeout or a lost connection: the transaction was rolled back; run it again."""


class Unreachable(RetryableError):
    """No connection could be made (the server down, unreachable or full): nothing was sent. Retryable,
    but not at once — ``Database.run`` does not run it again; its caller answers that the database is
    unavailable, and the client, cron or drain tries later."""


class CommitUnknown(RetryableError):
    """The connection was lost while COMMIT was in flight: the transaction may or may not have committed.
    Safe to run again only if the work is idempotent (``Database.run(..., idempotent=True)``)."""


class OutcomeUnknown(DatabaseError):
    """Work that is not idempotent lost its COMMIT answer: it may have been done. Not run again; the
    caller (or its client) looks before retrying."""


# Deadlock, lock wait timeout, a connection lost or out of sync.
_MYSQL_RETRYABLE = {1205, 1213, 2006, 2013, 2014}
# No connection made at all: the server down or unreachable (2003), or full (1040).
_MYSQL_UNREACHABLE = {1040, 2003}
# The connection went away (server gone, lost during the query): a COMMIT sent on it has no answer.
_COMMIT_LOST = {2006, 2013}


class Tx:
    """One open transaction. Obtained from ``Database.transaction()``; never kept past it.

    ``token``: a random number of the ``Database.run`` call, the same in each of its runs, written into
    the journal rows it posts. ``resumed``: an earlier run of this call lost its COMMIT answer, so rows
    carrying ``token`` may already be there.
    """

    def __init__(self, dialect: Dialect, cursor: Any) -> None:
        self.dialect = dialect
        self._cur = cursor
        self.lastrowid: int | None = None
        self.token: int = secrets.randbits(63)
        self.resumed = False

    async def execute(self, statement: str, params: Params = ()) -> int:
        """Run one statement; return the number of rows it changed."""
        try:
            await self._cur.execute(self.dialect.sql(statement), tuple(params))
        except (pymysql.err.IntegrityError, sqlite3.IntegrityError) as e:
            raise IntegrityError(str(e)) from e
        self.lastrowid = self._cur.lastrowid
        return int(self._cur.rowcount)

    async def executemany(self, statement: str, rows: Sequence[Params]) -> int:
        """Insert many rows. On MySQL ``INSERT ... VALUES (%s, ...)`` becomes one multi-row INSERT."""
        if not rows:
            return 0
        try:
            await self._cur.executemany(self.dialect.sql(statement), [tuple(r) for r in rows])
        except (pymysql.err.IntegrityError, sqlite3.IntegrityError) as e:
            raise IntegrityError(str(e)) from e
        return int(self._cur.rowcount)

    async def fetchone(self, statement: str, params: Params = ()) -> Row | None:
        await self._cur.execute(self.dialect.sql(statement), tuple(params))
        row: Any = await self._cur.fetchone()
        return None if row is None else tuple(row)

    async def fetchall(self, statement: str, params: Params = ()) -> list[Row]:
        await self._cur.execute(self.dialect.sql(statement), tuple(params))
        rows: Any = await self._cur.fetchall()
        return [tuple(r) for r in rows]


class Database:
    """A pool of connections to one database; use as an async context manager."""

    dialect: Dialect

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

    async def run(self, work: Callable[[Tx], Awaitable[T]], *, idempotent: bool, attempts: int = 5) -> T:
        """Run ``work`` in a transaction, again from the start after a deadlock or a lost connection (not
        when no connection can be made: ``Unreachable``, raised at once).

        ``idempotent``: whether running ``work`` again after its COMMIT answer was lost is safe (its
        writes are keyed, so a second run finds the first one's). If not, a lost COMMIT answer raises
        ``OutcomeUnknown`` and ``work`` is not run again."""
        token = secrets.randbits(63)
        resumed = False
        for attempt in range(1, attempts + 1):
            try:
                async with self.transaction() as tx:
                    tx.token, tx.resumed = token, resumed
                    return await work(tx)
            except CommitUnknown as e:
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
                log.warning("transaction retried after a retryable error (attempt %d)", attempt)
                await asyncio.sleep(0.01 * attempt)
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


def _mysql_error(e: pymysql.err.OperationalError) -> DatabaseError:
    if e.args and e.args[0] in _MYSQL_UNREACHABLE:
        return Unreachable(str(e))
    if e.args and e.args[0] in _MYSQL_RETRYABLE:
        return RetryableError(str(e))
    return DatabaseError(str(e))


class MySQLDatabase(Database):
    dialect = MYSQL

    def __init__(self, pool: Any) -> None:
        self._pool = pool

    def connections_in_use(self) -> int:
        return int(self._pool.size - self._pool.freesize)

    @classmethod
    async def connect(cls, url: str, pool_size: int) -> MySQLDatabase:
        u = urlparse(url)
        host, port, name = u.hostname or "127.0.0.1", u.port or 3306, u.path.lstrip("/") or "redpacket"
        try:
            pool = await aiomysql.create_pool(
                host=host,
                port=port,
                user=unquote(u.username or "root"),
                password=unquote(u.password or ""),
                db=name,
                # A transaction is an explicit BEGIN ... COMMIT (``transaction``); a lone read is one
                # statement and one round trip (``fetchone`` / ``fetchall``).
                autocommit=True,
                minsize=1,
                maxsize=pool_size,
                charset="utf8mb4",
                connect_timeout=5,
                # Every rule that guards money is a unique key or a conditional UPDATE; READ COMMITTED lets
                # the lookup after a duplicate-key error see the row that won the race.
                init_command="SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED",
            )
        except (pymysql.err.Error, OSError) as e:
            code = e.args[0] if isinstance(e, pymysql.err.Error) and e.args else None
            detail = e.args[1] if isinstance(e, pymysql.err.Error) and len(e.args) > 1 else str(e)
            if code == 1049:
                what = f"MySQL on {host}:{port} has no database {name!r} (create it, or name another)"
            elif code in (1045, 1698):
                what = f"MySQL on {host}:{port} refused the user and password"
            elif code == 1044:
                what = f"MySQL on {host}:{port} does not let this user use {name!r}"
            elif code in (None, 2003, 2005, 2013):
                what = f"the MySQL server on {host}:{port} does not answer"
            else:
                what = f"cannot connect to MySQL database {name!r} on {host}:{port}"
            raise DatabaseError(f"{what}: {detail}") from e
        return cls(pool)

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[Tx]:
        try:
            async with self._pool.acquire() as conn:
                await conn.begin()
                try:
                    async with conn.cursor() as cur:
                        yield Tx(self.dialect, cur)
                except BaseException:
                    # A broken connection cannot roll back; closing it drops the transaction anyway.
                    try:
                        await conn.rollback()
                    except Exception:
                        conn.close()
                    raise
                try:
                    await conn.commit()
                except BaseException as e:
                    conn.close()
                    lost = isinstance(e, pymysql.err.InterfaceError) or (
                        isinstance(e, pymysql.err.OperationalError)
                        and bool(e.args)
                        and e.args[0] in _COMMIT_LOST
                    )
                    if lost:  # the server may have committed and its answer was lost
                        raise CommitUnknown(str(e)) from e
                    raise  # an answer (a deadlock at commit, say): rolled back; cancelled: unknown, as said
        except pymysql.err.OperationalError as e:
            raise _mysql_error(e) from e
        except pymysql.err.InterfaceError as e:
            raise RetryableError(str(e)) from e

    @asynccontextmanager
    async def snapshot(self) -> AsyncIterator[Tx]:
        # The pool's sessions read committed; this one transaction reads InnoDB's snapshot of its start.
        try:
            async with self._pool.acquire() as conn, conn.cursor() as cur:
                await cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                await cur.execute("START TRANSACTION WITH CONSISTENT SNAPSHOT, READ ONLY")
                try:
                    yield Tx(self.dialect, cur)
                finally:
                    try:
                        await conn.rollback()  # read only: nothing to keep
                    except Exception:
                        conn.close()
        except pymysql.err.OperationalError as e:
            raise _mysql_error(e) from e
        except pymysql.err.InterfaceError as e:
            raise RetryableError(str(e)) from e

    async def _read(self, statement: str, params: Params) -> list[Row]:
        """One statement in autocommit: no BEGIN and COMMIT round trips around a lone read."""
        try:
            async with self._pool.acquire() as conn, conn.cursor() as cur:
                await cur.execute(self.dialect.sql(statement), tuple(params))
                rows: Any = await cur.fetchall()
        except pymysql.err.OperationalError as e:
            raise _mysql_error(e) from e
        except pymysql.err.InterfaceError as e:
            raise RetryableError(str(e)) from e
        return [tuple(r) for r in rows]

    async def close(self) -> None:
        self._pool.close()
        await self._pool.wait_closed()


def _sqlite_error(e: sqlite3.OperationalError) -> DatabaseError:
    if "locked" in str(e) or "busy" in str(e):
        return RetryableError(str(e))
    return DatabaseError(str(e))


class SQLiteDatabase(Database):
    """One connection behind a lock for transactions: SQLite has one writer at a time anyway. A read of
    one statement outside a transaction (``fetchone`` / ``fetchall``) goes to a second connection
    instead, without the lock and in one trip to aiosqlite's thread: in WAL mode it sees every committed
    transaction and never waits for a writer (a reconnect storm is 10,000 of them)."""

    dialect = SQLITE

    def __init__(
        self, conn: aiosqlite.Connection, reader: aiosqlite.Connection | None = None, path: str = ":memory:"
    ) -> None:
        self._conn = conn
        self._reader = reader
        self._path = path
        self._lock = asyncio.Lock()

    def connections_in_use(self) -> int:
        return int(self._lock.locked())

    @asynccontextmanager
    async def snapshot(self) -> AsyncIterator[Tx]:
        if self._path == ":memory:":  # one connection: its transaction is the only consistent view
            async with self.transaction() as tx:
                yield tx
            return
        # A connection of its own: in WAL mode its read transaction sees the database as of its first
        # read until it ends, and no writer waits for it.
        conn = await aiosqlite.connect(self._path, isolation_level=None)
        try:
            await conn.execute("PRAGMA query_only=ON")
            cur = await conn.cursor()
            await cur.execute("BEGIN")
            try:
                yield Tx(self.dialect, cur)
            finally:
                await cur.execute("ROLLBACK")
        except sqlite3.OperationalError as e:
            raise _sqlite_error(e) from e
        finally:
            await conn.close()

    @classmethod
    async def connect(cls, path: str) -> SQLiteDatabase:
        try:
            if path != ":memory:":
                Path(path).parent.mkdir(parents=True, exist_ok=True)
            conn = await aiosqlite.connect(path, isolation_level=None)
            await conn.execute("PRAGMA journal_mode=WAL")
            await conn.execute("PRAGMA synchronous=FULL")
            await conn.execute("PRAGMA foreign_keys=ON")
            reader = None
            if path != ":memory:":  # a second in-memory connection would be another database
                reader = await aiosqlite.connect(path, isolation_level=None)
                await reader.execute("PRAGMA query_only=ON")
        except (sqlite3.Error, OSError) as e:
            raise DatabaseError(f"cannot open the SQLite database {path}: {e}") from e
        return cls(conn, reader, path)

    async def _read(self, statement: str, params: Params) -> list[Row]:
        if self._reader is None:  # in memory: the one connection, in a transaction
            return await super()._read(statement, params)
        try:
            rows: Any = await self._reader.execute_fetchall(self.dialect.sql(statement), tuple(params))
        except sqlite3.OperationalError as e:
            raise _sqlite_error(e) from e
        return [tuple(r) for r in rows]

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[Tx]:
        async with self._lock:
            cur = await self._conn.cursor()
            try:
                await cur.execute("BEGIN IMMEDIATE")
                try:
                    yield Tx(self.dialect, cur)
                    await cur.execute("COMMIT")
                except BaseException:
                    await cur.execute("ROLLBACK")
                    raise
            except sqlite3.OperationalError as e:
                raise _sqlite_error(e) from e
            finally:
                await cur.close()

    async def close(self) -> None:
        # Both, whatever happens to the first: each runs a thread that would keep the process alive.
        try:
            if self._reader is not None:
                await self._reader.close()
        finally:
            await self._conn.close()


async def connect(url: str, pool_size: int = 10) -> Database:
    """Open the database named by ``url``: ``mysql://user:pass@host:port/db`` or ``sqlite:///path``."""
    scheme = url.split(":", 1)[0]
    if scheme in ("mysql", "mariadb", "mysql+aiomysql"):
        return await MySQLDatabase.connect(url, pool_size)
    if scheme == "sqlite":
        return await SQLiteDatabase.connect(url[len("sqlite:///") :] or ":memory:")
    raise ValueError(f"unsupported database URL scheme {scheme!r}: use mysql:// or sqlite:///")
