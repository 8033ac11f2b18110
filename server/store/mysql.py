"""MySQL/MariaDB through aiomysql: one writer node at a time, the next live one when it fails.

**One URL, one or several hosts.** ``mysql://user:pw@h1:3306,h2:3306,h3:3306/db`` names the nodes of a
MariaDB Galera cluster (as MariaDB's own connectors accept). Every transaction and every read of a process
goes to one node, its *writer*, so every read sees the latest write, and every process of a deployment
writes through the same node (Galera's single-writer pattern: no certification conflicts between our own
processes). A process starts on the first host in the URL's order that answers and, on Galera, is
``Synced`` in the ``Primary`` component after a causal read — or on the node the others moved to, when
``db_writer`` names one that passes. When the writer fails (its connections drop, a statement outlives
``REDPACKET_DB_STATEMENT_TIMEOUT_MS``, it answers ``WSREP has not yet prepared node``), the process looks
at it once more with a fresh connection; if it is gone it moves to the next host in the URL's order
(wrapping) that passes, without a restart, records it in ``db_writer``, and stays there: it moves on
only when that node fails in turn, and back to the first only when told (``reset_writer``: ``kill -USR1``
a hub or a worker). A URL of one host (a plain server, or HAProxy or MaxScale in front of a cluster)
behaves as before: the pool reconnects to it.

**No stale read as if current.** On Galera every session sets ``wsrep_sync_wait=1``: a read waits until
the node has applied every write the cluster had committed when the read began, and a node cut off from
the cluster (a partition, a paused process) answers an error instead of what it last knew.

Timeouts: aiomysql has no read timeout (nor one for a server's greeting), so every statement, the wait
for a pooled connection and each look at a node run under one (``mysqlkit.bounded``). A COMMIT that
outlives it has an unknown outcome (``CommitUnknown``), as one whose connection drops. Work waiting for a
connection of a pool cut by a failover gives up within the timeout and runs again on the new pool.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import aiomysql
import pymysql

from server.store.db import (
    CommitUnknown,
    Database,
    DatabaseError,
    NotReady,
    Params,
    RetryableError,
    Row,
    Tx,
    Unreachable,
)
from server.store.dialect import MYSQL
from server.store.mysqlkit import (
    COMMIT_LOST,
    HEALTH,
    PROBE_SECONDS,
    SNAPSHOT_SECONDS,
    Move,
    MySQLTarget,
    NodeProblem,
    StatementTimedOut,
    as_ours,
    bounded,
    connect_cut,
    driver_error,
    error_code,
    no_writer,
    node_lost,
    parse_url,
)
from server.store.mysqltx import TimedTx, bind
from server.store.schema import now_ms

log = logging.getLogger(__name__)
T = TypeVar("T")


class MySQLDatabase(Database):
    dialect = MYSQL

    def __init__(self, target: MySQLTarget, pool_size: int, timeout: float) -> None:
        super().__init__()
        self.target = target
        self._pool_size = pool_size
        self._timeout = timeout
        # A look at one node (connect, greeting, a causal read): a node that accepts and never answers
        # (paused, partitioned) is given up on after this.
        self._probe_s = min(PROBE_SECONDS, timeout)
        self._pool: Any = None
        self._index = 0
        self._galera = False
        self._switching = asyncio.Lock()
        self._closing: set[asyncio.Future[None]] = set()  # old pools closing, the writer being recorded

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
            problem = await db._take(index)
            if problem is None:
                if len(db.target.hosts) > 1:
                    await db._join_the_others()
                return db
            problems.append(problem)
        raise no_writer(problems)

    async def _join_the_others(self) -> None:
        """Start on the node the deployment's other processes write through (``db_writer``, written by the
        last process that moved) when it is not this one and can be the writer: after a failover, a
        process started later would otherwise write through the first node of the URL, beside them."""
        try:
            row = await self.fetchone("SELECT address FROM db_writer WHERE id = 1")
        except (DatabaseError, pymysql.err.Error):
            return  # not migrated yet (no table), or the node went away: the first node it is
        addresses = [self.target.address(i) for i in range(len(self.target.hosts))]
        if row is None or str(row[0]) == self.writer or str(row[0]) not in addresses:
            return
        problem = await self._take(addresses.index(str(row[0])), graceful=True)
        if problem is not None:
            log.warning("could not join the deployment's writer %s: %s", row[0], problem)

    async def _say_writer(self) -> None:
        """Tell processes starting later which node this one moved to (``_join_the_others``)."""

        async def write(tx: Tx) -> None:
            await tx.execute(
                "INSERT INTO db_writer (id, address, set_ms) VALUES (1, %s, %s)"
                " ON DUPLICATE KEY UPDATE address = VALUES(address), set_ms = VALUES(set_ms)",
                (self.writer, now_ms()),
            )

        try:
            await self.run(write, idempotent=True, attempts=2)
        except Exception as e:  # a hint only (the table may not be there yet): the next move writes it
            log.warning("could not record the database writer %s: %s", self.writer, e)

    async def _probe(self, index: int) -> NodeProblem | None:
        """Why host ``index`` cannot be the writer, or None when it can: it answers, has the database, and
        on Galera is synced in the primary component. A fresh connection, bounded in time."""
        host, port = self.target.hosts[index]
        where = f"MySQL server on {self.target.address(index)}"
        name = self.target.database
        try:
            async with asyncio.timeout(self._probe_s):
                try:
                    conn = await aiomysql.connect(
                        host=host,
                        port=port,
                        user=self.target.user,
                        password=self.target.password,
                        db=name,
                        connect_timeout=self._probe_s,
                        autocommit=True,
                    )
                except RuntimeError as e:
                    if not connect_cut(e):
                        raise
                    raise pymysql.err.OperationalError(
                        2013, f"the connection was cut as it was made ({e})"
                    ) from e
                try:
                    async with conn.cursor() as cur:
                        await cur.execute("SHOW VARIABLES LIKE 'wsrep_on'")  # (none on Oracle's MySQL)
                        galera = [str(v) for _, v in await cur.fetchall()] == ["ON"]
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
        except TimeoutError:  # (before OSError: it is one)
            return NodeProblem(f"the {where} does not answer (no answer within {self._probe_s:g} s)")
        except (pymysql.err.Error, OSError) as e:
            code = error_code(e)
            detail = e.args[1] if isinstance(e, pymysql.err.Error) and len(e.args) > 1 else str(e)
            settling = False
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
                settling = True
            else:
                what = f"cannot connect to MySQL database {name!r} on {self.target.address(index)}"
            return NodeProblem(f"{what}: {detail}", settling)
        if galera:
            ready = state.get("wsrep_ready") == "ON"
            primary = state.get("wsrep_cluster_status") == "Primary"
            synced = state.get("wsrep_local_state_comment") == "Synced"
            if not (ready and primary and synced):
                shown = ", ".join(f"{k}={v}" for k, v in sorted(state.items()))
                node = self.target.address(index)
                return NodeProblem(
                    f"the Galera node {node} is not synced in the primary component ({shown})", True
                )
        self._galera = galera
        return None

    async def _use(self, index: int, graceful: bool = False) -> None:
        """Make host ``index`` the writer: a new pool to it. The old pool's connections are cut (its node
        is gone) or, ``graceful``, closed as their transactions end (an operator's move off a live node)."""
        host, port = self.target.hosts[index]
        init = "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED"
        if self._galera:  # (one statement: MariaDB's name for the isolation variable, beside Galera's)
            init = "SET SESSION tx_isolation = 'READ-COMMITTED', SESSION wsrep_sync_wait = 1"
        make = aiomysql.create_pool(
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
            connect_timeout=self._probe_s,
            # Every rule that guards money is a unique key or a conditional UPDATE; READ COMMITTED lets
            # the lookup after a duplicate-key error see the row that won the race.
            init_command=init,
        )
        pool = await bounded(make, self._probe_s)
        old, self._pool, self._index = self._pool, pool, index
        if old is not None:
            old.close() if graceful else old.terminate()
            # Tasks waiting for one of its connections give up after their statement timeout, and run
            # again on the new pool ("failover").
            self._background(self._closed(old))

    async def _closed(self, pool: Any) -> None:
        try:
            await bounded(pool.wait_closed(), self._timeout)
        except (StatementTimedOut, pymysql.err.Error, OSError):
            pool.terminate()

    async def _node_failed(self, pool: Any) -> Move:
        """The writer behind ``pool`` failed: look at it once more; if it is gone, move to the next host
        that can be the writer. ``moved`` (this process now writes elsewhere, or another task moved it),
        ``stayed`` (a dropped connection, the node itself fine; or one host only: its pool reconnects),
        ``none`` (no host can be the writer now) or ``settling`` (none can, but one answered not ready)."""
        if len(self.target.hosts) == 1:
            return "stayed"
        async with self._switching:
            before = self._pool
            after = await self._move_on(pool)
        if self._pool is not before:  # this call moved: said in the background (the retry goes on)
            self._background(self._say_writer())
        return after

    async def _move_on(self, pool: Any) -> Move:
        if pool is not self._pool:
            return "moved"  # another task has moved meanwhile
        problem = await self._probe(self._index)
        if problem is None:
            return "stayed"
        problems = [problem]
        for step in range(1, len(self.target.hosts)):
            index = (self._index + step) % len(self.target.hosts)
            problem = await self._take(index)
            if problem is None:
                log.warning("database writer failed (%s): moved to %s", problems[0], self.writer)
                self.health.failovers += 1
                return "moved"
            problems.append(problem)
        log.warning(
            "database writer %s failed and no node can take over: %s",
            self.writer,
            "; ".join(map(str, problems)),
        )
        return "settling" if any(p.settling for p in problems) else "none"

    async def _take(self, index: int, graceful: bool = False) -> NodeProblem | None:
        """Make host ``index`` the writer if it can be one (``_probe``, then ``_use``): None when done,
        else why not."""
        problem = await self._probe(index)
        if problem is not None:
            return problem
        try:
            await self._use(index, graceful)
        except (pymysql.err.Error, OSError) as e:  # (StatementTimedOut included)
            return NodeProblem(f"the MySQL server on {self.target.address(index)} took no pool: {e}")
        return None

    async def reset_writer(self) -> str:
        """Go back to the first host in the URL's order that can be the writer (an operator's choice, e.g.
        after the preferred node is back); return the writer's address."""
        async with self._switching:
            was = self._index
            for index in range(was):  # the hosts before this one, first first
                problem = await self._take(index, graceful=True)
                if problem is None:
                    break
                log.warning("could not go back to %s: %s", self.target.address(index), problem)
        if self._index != was:
            await self._say_writer()
        return self.writer

    def _background(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _failure(self, pool: Any, e: BaseException) -> DatabaseError:
        """The error to raise for the driver's ``e``, after moving to another node if the writer is gone."""
        after = await self._node_failed(pool) if node_lost(e) else "stayed"
        if after == "none":
            return Unreachable(f"no database node can take writes now ({e})")
        if after == "settling":
            return NotReady(f"no database node can take writes now: the cluster is settling ({e})")
        return as_ours(e, moved=after == "moved")

    @asynccontextmanager
    async def _connection(self) -> AsyncIterator[tuple[Any, Any]]:
        """A connection of the writer's pool, and that pool; errors turned into ours (after a failover
        when the writer is gone). Exceptions raised by the caller's block pass through unchanged unless
        they are the driver's."""
        pool = self._pool
        try:
            conn = await bounded(pool.acquire(), self._timeout)
        except Exception as e:
            replaced = pool is not self._pool  # (closed by a failover: aiomysql raises RuntimeError)
            if not (driver_error(e) or (replaced and isinstance(e, RuntimeError))):
                raise
            if replaced:  # cut by a failover before or while this waited: the new pool's turn
                raise RetryableError(f"the pool was replaced ({e})", reason="failover") from e
            if isinstance(e, StatementTimedOut) and pool.freesize == 0 and pool.size >= pool.maxsize:
                # Every connection busy the whole time: a loaded process, not a lost node.
                raise RetryableError(f"no free database connection ({e})", reason="busy") from e
            raise await self._failure(pool, e) from e
        try:
            yield conn, pool
        except Exception as e:
            if not driver_error(e):
                raise
            raise await self._failure(pool, e) from e
        finally:
            pool.release(conn)

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[Tx]:
        async with self._connection() as (conn, pool):
            await bounded(conn.begin(), self._timeout)
            try:
                async with conn.cursor() as cur:
                    yield TimedTx(cur, self._timeout)
            except BaseException:
                # A broken connection cannot roll back; closing it drops the transaction anyway.
                try:
                    await bounded(conn.rollback(), self._timeout)
                except Exception:
                    conn.close()
                raise
            try:
                await bounded(conn.commit(), self._timeout)
            except BaseException as e:
                lost = (
                    isinstance(e, pymysql.err.InterfaceError | StatementTimedOut)
                    or error_code(e) in COMMIT_LOST
                )
                if lost or not isinstance(e, pymysql.err.Error):
                    conn.close()  # broken, or cancelled mid-COMMIT: its state unknown
                if not lost:
                    raise  # an answer (a deadlock at commit, say): rolled back; cancelled: unknown, as said
                # The server may have committed and its answer was lost: whatever the look at the node
                # finds (or fails with), the caller hears that the outcome is unknown — unless cancelled.
                try:
                    await self._node_failed(pool)
                except Exception as looking:
                    log.warning("after a lost COMMIT answer, the look at the node failed: %s", looking)
                raise CommitUnknown(str(e) or "the COMMIT outlived the statement timeout") from e

    @asynccontextmanager
    async def snapshot(self) -> AsyncIterator[Tx]:
        # The pool's sessions read committed; this one transaction reads InnoDB's snapshot of its start.
        async with self._connection() as (conn, _), conn.cursor() as cur:
            await bounded(cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ"), self._timeout)
            await bounded(cur.execute("START TRANSACTION WITH CONSISTENT SNAPSHOT, READ ONLY"), self._timeout)
            try:
                yield TimedTx(cur, max(self._timeout, SNAPSHOT_SECONDS))
            finally:
                try:
                    await bounded(conn.rollback(), self._timeout)  # read only: nothing to keep
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
            await bounded(cur.execute(bind(conn, statement, params)), self._timeout)
            rows: Any = await cur.fetchall()
        return [tuple(r) for r in rows]

    async def close(self) -> None:
        """Close the pool once its connections are back (cut after the statement timeout otherwise)."""
        self._pool.close()
        await self._closed(self._pool)
        for task in list(self._closing):
            await task
