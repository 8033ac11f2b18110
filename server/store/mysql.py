"""MySQL/MariaDB through aiomysql: one writer node at a time, the next live one when it fails.

**One URL, one or several hosts.** ``mysql://user:pw@h1:3306,h2:3306,h3:3306/db`` names the nodes of a
MariaDB Galera cluster (as MariaDB's own connectors accept). Every transaction and every read of a process
goes to one node, its *writer* — the first host in the URL's order that answers and, on Galera, is
``Synced`` in the ``Primary`` component — so every process of a deployment writes through the same node
(Galera's single-writer pattern: no certification conflicts between our own processes) and every read sees
the latest write. When the writer fails (its connections drop, a statement outlives
``REDPACKET_DB_STATEMENT_TIMEOUT_MS``, it answers ``WSREP has not yet prepared node``), the process looks
at it once more with a fresh connection; if it is gone it moves to the next host that is live and synced,
without a restart, and stays there: it moves back only on that node's failure, or when told
(``reset_writer``: ``kill -HUP`` a hub or a worker). A URL of one host (a plain server, or HAProxy or
MaxScale in front of a cluster) behaves as before: the pool reconnects to it.

**No stale read as if current.** On Galera every session sets ``wsrep_sync_wait=1``: a read waits until
the node has applied every write the cluster had committed when the read began, and a node cut off from
the cluster (a partition, a paused process) answers an error instead of what it last knew.

Timeouts: aiomysql has no read timeout, so every statement here runs under ``asyncio.timeout``. A COMMIT
that outlives it has an unknown outcome (``CommitUnknown``), as one whose connection drops.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import unquote, urlparse

import aiomysql
import pymysql

from server.store.db import (
    CommitUnknown,
    Database,
    DatabaseError,
    Params,
    RetryableError,
    Row,
    Tx,
    Unreachable,
)
from server.store.dialect import MYSQL

log = logging.getLogger(__name__)
T = TypeVar("T")

# Why a transaction is run again, by the server's error number (``Database.health.retries`` counts them).
RETRY_REASONS = {
    1205: "lock_wait",  # lock wait timeout
    1213: "deadlock",  # a deadlock, or on Galera a certification conflict at COMMIT
    1047: "node_not_ready",  # Galera: WSREP has not yet prepared node for application use
    2006: "connection",  # server has gone away
    2013: "connection",  # lost connection during query
    2014: "connection",  # commands out of sync
    1927: "connection",  # connection killed
    1053: "connection",  # server shutdown in progress
}
# No connection made at all: the server down or unreachable (2003), or full (1040).
UNREACHABLE = {1040, 2003}
# The node itself may be gone: look at it again, and move to the next host if it is.
NODE_LOST = {1047, 1053, 1927, 2003, 2006, 2013}
# The connection went away (server gone, lost during the query): a COMMIT sent on it has no answer.
COMMIT_LOST = {1053, 1927, 2006, 2013}

HEALTH = (
    "SHOW GLOBAL STATUS WHERE Variable_name IN"
    " ('wsrep_ready', 'wsrep_cluster_status', 'wsrep_local_state_comment')"
)


@dataclass(frozen=True)
class MySQLTarget:
    """What a ``mysql://`` URL names: its hosts in order, the user, the password and the database."""

    hosts: tuple[tuple[str, int], ...]
    user: str
    password: str
    database: str

    def address(self, index: int) -> str:
        host, port = self.hosts[index]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_url(url: str) -> MySQLTarget:
    """``mysql://user:pw@host:port,host:port/db`` (or ``mariadb://``): hosts kept in the URL's order."""
    _, _, rest = url.partition("://")
    netloc, _, path = rest.partition("/")
    userinfo, _, hostlist = netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    hosts = []
    for host in hostlist.split(","):
        u = urlparse(f"x://{host}")
        hosts.append((u.hostname or "127.0.0.1", u.port or 3306))
    return MySQLTarget(
        hosts=tuple(hosts),
        user=unquote(user or "root"),
        password=unquote(password),
        database=path.split("?", 1)[0] or "redpacket",
    )


def _code(e: BaseException) -> int | None:
    if isinstance(e, pymysql.err.Error) and e.args and isinstance(e.args[0], int):
        return e.args[0]
    return None


def _lost(e: BaseException) -> bool:
    """Whether ``e`` says the node (or the way to it) may be gone, rather than a statement refused."""
    return isinstance(e, TimeoutError | OSError | pymysql.err.InterfaceError) or _code(e) in NODE_LOST


def _retryable(e: BaseException, moved: bool) -> DatabaseError:
    """The error a caller sees for ``e``: retryable (with its reason), unreachable, or neither."""
    code = _code(e)
    if moved:
        return RetryableError(f"the database node failed; moved to the next ({e})", reason="failover")
    if code in UNREACHABLE:
        return Unreachable(str(e))
    if isinstance(e, TimeoutError):
        return RetryableError("a statement outlived the statement timeout", reason="timeout")
    if code in RETRY_REASONS:
        return RetryableError(str(e), reason=RETRY_REASONS[code])
    if isinstance(e, OSError | pymysql.err.InterfaceError):
        return RetryableError(str(e), reason="connection")
    return DatabaseError(str(e))


class TimedTx(Tx):
    """A transaction whose every statement is bounded in time (aiomysql has no read timeout)."""

    def __init__(self, cursor: Any, timeout: float) -> None:
        super().__init__(MYSQL, cursor)
        self._timeout = timeout

    async def _run(self, step: Awaitable[T]) -> T:
        async with asyncio.timeout(self._timeout):
            return await step


class MySQLDatabase(Database):
    dialect = MYSQL

    def __init__(self, target: MySQLTarget, pool_size: int, timeout: float) -> None:
        super().__init__()
        self.target = target
        self._pool_size = pool_size
        self._timeout = timeout
        self._pool: Any = None
        self._index = 0
        self._galera = False
        self._switching = asyncio.Lock()
        self._closing: set[asyncio.Task[None]] = set()

    @property
    def writer(self) -> str:
        """The node this process writes to and reads from."""
        return self.target.address(self._index)

    def connections_in_use(self) -> int:
        return int(self._pool.size - self._pool.freesize)

    @classmethod
    async def connect(cls, url: str, pool_size: int, timeout: float = 10.0) -> MySQLDatabase:
        db = cls(parse_url(url), pool_size, timeout)
        problems = []
        for index in range(len(db.target.hosts)):
            problem = await db._probe(index)
            if not problem:
                await db._use(index)
                return db
            problems.append(problem)
        raise DatabaseError("; ".join(problems))

    async def _probe(self, index: int) -> str:
        """Why host ``index`` cannot be the writer (one line), or "" when it can: it answers, has the
        database, and on Galera is synced in the primary component. A fresh connection, bounded in time."""
        host, port = self.target.hosts[index]
        where = f"MySQL server on {self.target.address(index)}"
        name = self.target.database
        try:
            async with asyncio.timeout(self._timeout):
                conn = await aiomysql.connect(
                    host=host,
                    port=port,
                    user=self.target.user,
                    password=self.target.password,
                    db=name,
                    connect_timeout=min(5.0, self._timeout),
                    autocommit=True,
                )
                try:
                    async with conn.cursor() as cur:
                        await cur.execute("SELECT @@wsrep_on")
                        galera = bool(((await cur.fetchone()) or (0,))[0])
                        state: dict[str, str] = {}
                        if galera:
                            # A causal read first: a node back from a pause still says Synced and Primary
                            # until it hears it was dropped; this waits to hear from the cluster (or errs).
                            await cur.execute("SET SESSION wsrep_sync_wait = 1")
                            await cur.execute("SELECT 1")
                            await cur.fetchall()
                            await cur.execute(HEALTH)
                            state = {str(k): str(v) for k, v in await cur.fetchall()}
                finally:
                    conn.close()
        except (pymysql.err.Error, OSError) as e:
            code = _code(e)
            detail = e.args[1] if isinstance(e, pymysql.err.Error) and len(e.args) > 1 else str(e)
            if code == 1049:
                what = f"{where} has no database {name!r} (create it, or name another)"
            elif code in (1045, 1698):
                what = f"{where} refused the user and password"
            elif code == 1044:
                what = f"{where} does not let this user use {name!r}"
            elif code in (None, 2003, 2005, 2013):
                what = f"the {where} does not answer"
            elif code in (1047, 1205):  # a Galera node out of the cluster, or not caught up with it
                what = f"the Galera node {self.target.address(index)} cannot serve current reads"
            else:
                what = f"cannot connect to MySQL database {name!r} on {self.target.address(index)}"
            return f"{what}: {detail}"
        except TimeoutError:
            return f"the {where} does not answer (timed out)"
        if galera:
            ready = state.get("wsrep_ready") == "ON"
            primary = state.get("wsrep_cluster_status") == "Primary"
            synced = state.get("wsrep_local_state_comment") == "Synced"
            if not (ready and primary and synced):
                shown = ", ".join(f"{k}={v}" for k, v in sorted(state.items()))
                node = self.target.address(index)
                return f"the Galera node {node} is not synced in the primary component ({shown})"
        self._galera = galera
        return ""

    async def _use(self, index: int) -> None:
        """Make host ``index`` the writer: a new pool to it; the old one's connections are closed."""
        host, port = self.target.hosts[index]
        init = "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED"
        if self._galera:  # (one statement: MariaDB's name for the isolation variable, beside Galera's)
            init = "SET SESSION tx_isolation = 'READ-COMMITTED', SESSION wsrep_sync_wait = 1"
        pool = await aiomysql.create_pool(
            host=host,
            port=port,
            user=self.target.user,
            password=self.target.password,
            db=self.target.database,
            # A transaction is an explicit BEGIN ... COMMIT (``transaction``); a lone read is one
            # statement and one round trip (``fetchone`` / ``fetchall``).
            autocommit=True,
            minsize=1,
            maxsize=self._pool_size,
            charset="utf8mb4",
            connect_timeout=min(5.0, self._timeout),
            # Every rule that guards money is a unique key or a conditional UPDATE; READ COMMITTED lets
            # the lookup after a duplicate-key error see the row that won the race.
            init_command=init,
        )
        old, self._pool, self._index = self._pool, pool, index
        self.health.writer = self.writer
        if old is not None:
            old.terminate()
            task = asyncio.get_running_loop().create_task(old.wait_closed())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def _node_failed(self, pool: Any) -> str:
        """The writer behind ``pool`` failed: look at it once more; if it is gone, move to the next host
        that can be the writer. ``moved`` (this process now writes elsewhere, or another task moved it),
        ``stayed`` (a dropped connection, the node itself fine; or one host only: its pool reconnects) or
        ``none`` (no host can be the writer now)."""
        if len(self.target.hosts) == 1:
            return "stayed"
        async with self._switching:
            if pool is not self._pool:
                return "moved"
            problem = await self._probe(self._index)
            if not problem:
                return "stayed"
            problems = [problem]
            for step in range(1, len(self.target.hosts)):
                index = (self._index + step) % len(self.target.hosts)
                problem = await self._probe(index)
                if not problem:
                    moving = self.target.address(index)
                    log.warning(
                        "database writer %s failed (%s): moving to %s", self.writer, problems[0], moving
                    )
                    await self._use(index)
                    self.health.failovers += 1
                    return "moved"
                problems.append(problem)
            log.warning(
                "database writer %s failed and no other node can take over: %s",
                self.writer,
                "; ".join(problems),
            )
            return "none"

    async def reset_writer(self) -> str:
        """Go back to the first host in the URL's order that can be the writer (an operator's choice, e.g.
        after the preferred node is back); return the writer's address."""
        async with self._switching:
            for index in range(len(self.target.hosts)):
                if index == self._index:
                    break
                if not await self._probe(index):
                    await self._use(index)
                    break
        return self.writer

    async def _failure(self, pool: Any, e: BaseException) -> DatabaseError:
        """The error to raise for the driver's ``e``, after moving to another node if the writer is gone."""
        after = await self._node_failed(pool) if _lost(e) else "stayed"
        if after == "none":
            return Unreachable(f"no database node can take writes now ({e})")
        return _retryable(e, moved=after == "moved")

    @asynccontextmanager
    async def _connection(self) -> AsyncIterator[tuple[Any, Any]]:
        """A connection of the writer's pool, and that pool; errors turned into ours (after a failover
        when the writer is gone). Exceptions raised by the caller's block pass through unchanged unless
        they are the driver's."""
        pool = self._pool
        try:
            async with pool.acquire() as conn:
                yield conn, pool
        except (pymysql.err.OperationalError, pymysql.err.InterfaceError, TimeoutError, OSError) as e:
            raise await self._failure(pool, e) from e
        except RuntimeError as e:  # the pool was closed by a failover while this waited for a connection
            if pool is self._pool:
                raise
            raise RetryableError(str(e), reason="failover") from e

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[Tx]:
        async with self._connection() as (conn, pool):
            async with asyncio.timeout(self._timeout):
                await conn.begin()
            try:
                async with conn.cursor() as cur:
                    yield TimedTx(cur, self._timeout)
            except BaseException:
                # A broken connection cannot roll back; closing it drops the transaction anyway.
                try:
                    async with asyncio.timeout(self._timeout):
                        await conn.rollback()
                except Exception:
                    conn.close()
                raise
            try:
                async with asyncio.timeout(self._timeout):
                    await conn.commit()
            except BaseException as e:
                conn.close()
                lost = isinstance(e, pymysql.err.InterfaceError | TimeoutError) or _code(e) in COMMIT_LOST
                if lost:  # the server may have committed and its answer was lost
                    await self._node_failed(pool)
                    raise CommitUnknown(str(e) or "the COMMIT outlived the statement timeout") from e
                raise  # an answer (a deadlock at commit, say): rolled back; cancelled: unknown, as said

    @asynccontextmanager
    async def snapshot(self) -> AsyncIterator[Tx]:
        # The pool's sessions read committed; this one transaction reads InnoDB's snapshot of its start.
        async with self._connection() as (conn, _), conn.cursor() as cur:
            async with asyncio.timeout(self._timeout):
                await cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                await cur.execute("START TRANSACTION WITH CONSISTENT SNAPSHOT, READ ONLY")
            try:
                yield TimedTx(cur, self._timeout)
            finally:
                try:
                    async with asyncio.timeout(self._timeout):
                        await conn.rollback()  # read only: nothing to keep
                except Exception:
                    conn.close()

    async def _read(self, statement: str, params: Params) -> list[Row]:
        """One statement in autocommit: no BEGIN and COMMIT round trips around a lone read. Asked once
        more on the next node when its writer was found gone (a read has nothing to undo)."""
        try:
            return await self._read_once(statement, params)
        except RetryableError as e:
            if e.reason != "failover":
                raise
            self.health.retries[e.reason] += 1
            return await self._read_once(statement, params)

    async def _read_once(self, statement: str, params: Params) -> list[Row]:
        async with self._connection() as (conn, _), conn.cursor() as cur:
            async with asyncio.timeout(self._timeout):
                await cur.execute(self.dialect.sql(statement), tuple(params))
                rows: Any = await cur.fetchall()
        return [tuple(r) for r in rows]

    async def close(self) -> None:
        self._pool.close()
        await self._pool.wait_closed()
        for task in list(self._closing):
            await task
