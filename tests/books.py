"""The ledger's books as tests read and move them: paying what the grabs queued as a worker does, the
checks that the books balance and how many grabs are credited, the rows a test sets by hand, and a
MariaDB session of the test's own that holds what the system under test waits for."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from urllib.parse import urlparse

import pymysql

from server.core import Core
from server.store.db import Database, Tx
from worker.drain import CreditDrain


async def run_worker(core: Core) -> int:
    """Pay every queued credit as a worker does; return how many queue entries were handled (paid now,
    found paid already, or refused). (No cron jobs: tests call those directly.)"""
    drain = CreditDrain(core)
    await drain.until_empty()
    return drain.processed


async def assert_books_balance(core: Core) -> None:
    """Every account's journal sums to its balance."""
    rows = await core.db.fetchall(
        "SELECT a.user_id, a.balance, COALESCE(SUM(j.amount), 0) FROM accounts a"
        " LEFT JOIN journal j ON j.account_id = a.user_id GROUP BY a.user_id, a.balance"
    )
    assert rows and all(int(r[1]) == int(r[2]) for r in rows), rows


async def credited_count(db: Database) -> int:
    """How many grab records are credited."""
    row = await db.fetchone("SELECT COUNT(*) FROM grab_records WHERE status = 'credited'")
    return int(row[0]) if row else 0


async def credited_is(db: Database, n: int) -> bool:
    """Exactly ``n`` grab records are credited (a condition to wait on with ``eventually``)."""
    return await credited_count(db) == n


async def set_paid_count(core: Core, packet_id: int, count: int | None) -> None:
    """Write a packet's count of shares paid by hand (None: as a packet sent before it was kept)."""

    async def write(tx: Tx) -> int:
        sql = "UPDATE red_packets SET credited_count = %s WHERE id = %s"
        return await tx.execute(sql, (count, packet_id))

    assert await core.db.run(write, idempotent=False) == 1


async def past_expiry(core: Core, packet_id: int) -> int:
    """A 'now' just past the packet's expiry (the database and Redis agree on it)."""
    row = await core.db.fetchone("SELECT expires_ms FROM red_packets WHERE id = %s", (packet_id,))
    assert row is not None
    return int(row[0]) + 1


def side_session(
    database_url: str, autocommit: bool = False, *, in_database: bool = True, connect_timeout: float = 10
) -> pymysql.connections.Connection:
    """A MariaDB connection of the test's own (another client's) to the server of ``database_url``: in its
    database, or in none (``in_database=False``)."""
    u = urlparse(database_url)
    return pymysql.connect(
        host=u.hostname or "127.0.0.1", port=u.port or 3306, user=u.username or "root",
        password=u.password or "", database=u.path.lstrip("/") if in_database else None,
        autocommit=autocommit, connect_timeout=connect_timeout,
    )  # fmt: skip


@contextlib.contextmanager
def locked_tables(database_url: str, *tables: str) -> Iterator[None]:
    """While inside, another session holds ``tables`` (``LOCK TABLES … WRITE``): whatever reads or writes
    them waits. Closing the session releases them."""
    locker = side_session(database_url)
    try:
        with locker.cursor() as cur:
            cur.execute("LOCK TABLES " + ", ".join(f"{t} WRITE" for t in tables))
        yield
    finally:
        locker.close()
