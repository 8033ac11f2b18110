"""The ledger on SQLite through aiosqlite: the embedded default (one file under the data directory)."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiosqlite

from server.store.db import Database, DatabaseError, Params, RetryableError, Row, Tx
from server.store.dialect import SQLITE


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
        super().__init__()
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
