"""What a ``mysql://`` URL names and what the server's errors mean for the caller (pure, but ``bounded``,
which runs one statement under the statement timeout): which errors say a node may be gone, which are
worth running the transaction again for, and why (the reasons ``DatabaseHealth.retries`` counts)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Literal, TypeVar
from urllib.parse import unquote, urlparse

import pymysql

from server.store.db import DatabaseError, NotReady, RetryableError, Unreachable

T = TypeVar("T")

# Why a transaction is run again, by the server's error number (``Database.health.retries`` counts them).
RETRY_REASONS = {
    1205: "lock_wait",  # lock wait timeout
    1213: "deadlock",  # a deadlock, or on Galera a certification conflict at COMMIT
    1047: "node_not_ready",  # Galera: WSREP has not yet prepared node for application use
    1180: "node_not_ready",  # Galera: the write set not replicated (not connected to the primary component)
    2006: "connection",  # server has gone away
    2013: "connection",  # lost connection during query
    2014: "connection",  # commands out of sync
    1927: "connection",  # connection killed
    1053: "connection",  # server shutdown in progress
    # A Spider head (server.store.shards): a backend went away mid-statement.
    1430: "shard",  # a problem processing the query on the foreign data source
    12701: "shard",  # Spider: remote MySQL server has gone away
}
# No connection made at all: the server down or unreachable (2003), or full (1040); or, through a Spider
# head, one of its backends (1429: "unable to connect to foreign data source" — only that shard's rows).
UNREACHABLE = {1040, 2003, 1429}
# The node itself may be gone: look at it again, and move to the next host if it is.
NODE_LOST = {1047, 1053, 1180, 1927, 2003, 2006, 2013}
# The connection went away (server gone, lost during the query): a COMMIT sent on it has no answer. On a
# Spider head, a backend lost as the head commits on it: that backend's part may or may not be committed.
COMMIT_LOST = {1053, 1927, 2006, 2013, 1429, 1430, 12701}

PROBE_SECONDS = 5.0
# A reconciliation's snapshot reads the whole journal: its statements may take long on a big ledger.
SNAPSHOT_SECONDS = 600.0

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


def error_code(e: BaseException) -> int | None:
    if isinstance(e, pymysql.err.Error) and e.args and isinstance(e.args[0], int):
        return e.args[0]
    return None


def connect_cut(e: BaseException) -> bool:
    """aiomysql's error for a connection the server closed as it was made (a node being killed): its
    keep-alive setting finds no socket."""
    return isinstance(e, RuntimeError) and "does not expose socket" in str(e)


def node_lost(e: BaseException) -> bool:
    """Whether the driver's ``e`` says the node (or the way to it) may be gone, rather than a statement
    refused."""
    return (
        isinstance(e, StatementTimedOut | pymysql.err.InterfaceError)
        or error_code(e) in NODE_LOST
        or connect_cut(e)
    )


def as_ours(e: BaseException, moved: bool) -> DatabaseError:
    """The error a caller sees for the driver's ``e``: retryable (with its reason), unreachable, or
    neither."""
    code = error_code(e)
    if moved:
        return RetryableError(f"the database node failed; moved to the next ({e})", reason="failover")
    if code in UNREACHABLE:
        return Unreachable(str(e))
    if isinstance(e, StatementTimedOut):
        return RetryableError(f"a statement outlived the statement timeout ({e})", reason="timeout")
    if code in RETRY_REASONS:
        return RetryableError(str(e), reason=RETRY_REASONS[code])
    if isinstance(e, pymysql.err.InterfaceError) or connect_cut(e):
        return RetryableError(str(e), reason="connection")
    return DatabaseError(str(e))


@dataclass(frozen=True)
class NodeProblem:
    """Why a node cannot be the writer now, in one line. ``settling``: it answered but is not ready (not
    synced in the primary component, or its causal read was not served): a cluster dropping or taking in
    a node, ready again within seconds — unlike a node that is down, refuses us or lacks the database."""

    text: str
    settling: bool = False

    def __str__(self) -> str:
        return self.text


# After a failure of the writer: still the writer, another node now, or none (settling: one answered).
Move = Literal["stayed", "moved", "none", "settling"]


def no_writer(problems: list[NodeProblem]) -> DatabaseError:
    """The error when no node can be the writer: ``NotReady`` if one of them is settling."""
    text = "; ".join(map(str, problems))
    return NotReady(text) if any(p.settling for p in problems) else DatabaseError(text)


class StatementTimedOut(TimeoutError):
    """One of our statements (or the wait for a connection) outlived ``REDPACKET_DB_STATEMENT_TIMEOUT_MS``:
    told apart from a ``TimeoutError`` of the caller's own."""


async def bounded(step: Awaitable[T], seconds: float) -> T:
    """``step``, or ``StatementTimedOut`` after ``seconds`` (aiomysql has no read timeout of its own)."""
    try:
        async with asyncio.timeout(seconds):
            return await step
    except TimeoutError as e:
        raise StatementTimedOut(f"no answer within {seconds:g} s") from e


def driver_error(e: BaseException) -> bool:
    """Whether ``e`` came from the way to the server (the driver — aiomysql turns a socket's errors into
    its own — or our statement timeout), not from the caller's own code inside a transaction."""
    return isinstance(
        e, pymysql.err.OperationalError | pymysql.err.InterfaceError | StatementTimedOut
    ) or connect_cut(e)
