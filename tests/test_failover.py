"""A database URL of several hosts: one writer at a time, the next live one when it fails, back only when
told. Here the "nodes" are two proxies (``tests/dbproxy.py``) in front of the one MariaDB, so that each can
die (every connection closed, new ones refused), hang (nothing answered) or lose one connection while the
other stays up; ``tests/test_galera.py`` does the same with real Galera nodes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import urlparse

import pytest

from server.live.dbmetrics import DatabaseCollector
from server.money import journal, ledger
from server.store.db import Database, Tx, Unreachable
from server.store.engines import connect
from server.store.mysql import MySQLDatabase
from tests.conftest import name_deployment
from tests.dbproxy import MySQLProxy, mysql_proxy
from tests.hubtools import eventually


def _url(mysql_url: str, *ports: int) -> str:
    u = urlparse(mysql_url)
    user = u.netloc.rpartition("@")[0]
    hosts = ",".join(f"127.0.0.1:{p}" for p in ports)
    return f"{u.scheme}://{user}@{hosts}{u.path}"


@pytest.fixture
async def two(mysql_url: str) -> AsyncIterator[tuple[MySQLProxy, MySQLProxy]]:
    async with mysql_proxy(mysql_url) as a, mysql_proxy(mysql_url) as b:
        yield a, b


@pytest.fixture
async def migrated(mysql_url: str) -> str:
    await name_deployment(mysql_url)
    return mysql_url


@asynccontextmanager
async def _through(
    migrated: str, two: tuple[MySQLProxy, MySQLProxy], pool: int, timeout: float = 10.0
) -> AsyncIterator[Database]:
    """A database on the URL naming both proxies (first ``a``, then ``b``); on the way out, both proxies
    pass everything again."""
    a, b = two
    db = await connect(_url(migrated, a.port, b.port), pool, statement_timeout=timeout)
    try:
        yield db
    finally:
        a.restore()
        b.restore()
        await db.close()


async def _topups(db: Database, user: int, n: int, prefix: str) -> None:
    for i in range(n):
        assert await ledger.topup(db, user, 100, f"{prefix}{i}")


async def _journal(db: Database, user: int) -> tuple[int, int]:
    row = await db.fetchone(
        "SELECT COUNT(*), COALESCE(SUM(amount), 0) FROM journal WHERE account_id = %s", (user,)
    )
    assert row is not None
    return int(row[0]), int(row[1])


async def test_the_first_host_that_answers_is_the_writer(
    migrated: str, two: tuple[MySQLProxy, MySQLProxy]
) -> None:
    a, b = two
    a.go_down()
    async with _through(migrated, two, 2) as db:
        assert db.writer == f"127.0.0.1:{b.port}"
        metrics = DatabaseCollector()
        metrics.watch(db)
        reported = {m.name: m.samples for m in metrics.collect()}  # what /metrics shows of it
        assert [(s.labels, s.value) for s in reported["redpacket_db_writer"]] == [({"writer": db.writer}, 1)]
        assert await db.fetchone("SELECT 1") == (1,)


async def test_no_host_answering_is_one_line_naming_each(migrated: str) -> None:
    with pytest.raises(Exception) as e:
        await connect(_url(migrated, 1, 2), 2)
    assert "127.0.0.1:1 does not answer" in str(e.value) and "127.0.0.1:2 does not answer" in str(e.value)


async def test_a_writer_killed_mid_work_moves_the_process_to_the_next_and_it_stays(
    migrated: str, two: tuple[MySQLProxy, MySQLProxy]
) -> None:
    a, b = two
    async with _through(migrated, two, 4) as db:
        assert isinstance(db, MySQLDatabase)
        user = await ledger.create_user(db, "failover")
        await _topups(db, user, 5, "before")
        assert db.writer == f"127.0.0.1:{a.port}"
        # The node dies under a transaction that holds a connection: it is run again on the next node.
        started = asyncio.Event()
        release = asyncio.Event()

        async def held(tx: Tx) -> bool:
            started.set()
            await release.wait()
            return await journal.post(tx, user, 100, "topup", "held")

        work = asyncio.create_task(db.run(held, idempotent=True))
        await started.wait()
        a.go_down()
        release.set()
        assert await work is True
        assert db.writer == f"127.0.0.1:{b.port}" and db.health.failovers == 1
        assert db.health.retries["failover"] + db.health.retries["connection"] >= 1, db.health.retries
        await _topups(db, user, 5, "after")
        assert await _journal(db, user) == (11, 1_100)
        assert await ledger.balance(db, user) == 1_100
        # The first node is back: the process stays where it moved until told.
        a.restore()
        await _topups(db, user, 2, "back")
        assert db.writer == f"127.0.0.1:{b.port}"
        assert await db.reset_writer() == f"127.0.0.1:{a.port}"
        await _topups(db, user, 2, "told")
        assert await _journal(db, user) == (15, 1_500)


async def test_a_writer_that_stops_answering_is_left_after_the_statement_timeout(
    migrated: str, two: tuple[MySQLProxy, MySQLProxy]
) -> None:
    a, b = two
    async with _through(migrated, two, 4, 1.0) as db:
        user = await ledger.create_user(db, "paused")
        await _topups(db, user, 2, "before")
        a.hang()
        await _topups(db, user, 2, "after")  # each within the timeout and a probe of the hung node
        assert db.writer == f"127.0.0.1:{b.port}"
        # The statement outlived its timeout, the node did not answer a fresh connection: moved.
        assert db.health.failovers == 1 and db.health.retries["failover"] >= 1, db.health.retries
        assert await _journal(db, user) == (4, 400)


async def test_a_connection_lost_on_a_live_writer_does_not_move_the_process(
    migrated: str, two: tuple[MySQLProxy, MySQLProxy]
) -> None:
    a, _ = two
    async with _through(migrated, two, 2) as db:
        user = await ledger.create_user(db, "blip")
        killed: list[int] = []

        async def held(tx: Tx) -> bool:
            if not killed:  # the first run's connection is killed under it
                row = await tx.fetchone("SELECT CONNECTION_ID()")
                assert row is not None
                killed.append(int(row[0]))
                await db_admin_kill(migrated, killed[0])
            return await journal.post(tx, user, 100, "topup", "blip")

        assert await db.run(held, idempotent=True) is True
        assert db.writer == f"127.0.0.1:{a.port}" and db.health.failovers == 0
        assert db.health.retries["connection"] == 1, db.health.retries
        assert await _journal(db, user) == (1, 100)


async def db_admin_kill(mysql_url: str, connection_id: int) -> None:
    """KILL one connection from another (what an operator or a proxy's idle timeout does)."""
    admin = await connect(mysql_url, 1)
    try:
        await admin.fetchall(f"KILL {connection_id}")
    finally:
        await admin.close()


async def test_every_host_gone_is_unreachable_at_once_and_the_next_call_finds_one_back(
    migrated: str, two: tuple[MySQLProxy, MySQLProxy]
) -> None:
    a, b = two
    async with _through(migrated, two, 2) as db:
        user = await ledger.create_user(db, "alldown")
        a.go_down()
        b.go_down()
        with pytest.raises(Unreachable):
            await ledger.topup(db, user, 100, "none")
        b.restore()
        assert await ledger.topup(db, user, 100, "back")
        assert db.writer == f"127.0.0.1:{b.port}"
        assert await _journal(db, user) == (1, 100)


async def test_a_commit_answer_lost_as_the_writer_dies_is_found_on_the_next_node_not_paid_twice(
    migrated: str, two: tuple[MySQLProxy, MySQLProxy]
) -> None:
    """The node commits, dies before answering: the process moves and runs the work again there, where
    Galera (here: the same server) has the first run's rows — found by the key, not written again."""
    a, b = two
    async with _through(migrated, two, 2) as db:
        user = await ledger.create_user(db, "lost")
        a.lose_commit_answers(1, after=b"topup:", then_down=True)
        assert await ledger.topup(db, user, 100, "once") is True  # its own first run's row, not a replay
        assert a.lost == 1 and db.writer == f"127.0.0.1:{b.port}"
        assert db.health.retries["commit_unknown"] == 1, db.health.retries
        assert await _journal(db, user) == (1, 100)
        assert await ledger.balance(db, user) == 100


async def test_a_commit_that_outlives_the_timeout_is_unknown_and_found_on_the_next_node(
    migrated: str, two: tuple[MySQLProxy, MySQLProxy]
) -> None:
    a, b = two
    async with _through(migrated, two, 2, 1.0) as db:
        user = await ledger.create_user(db, "held")
        a.hold_commit_answer()
        assert await ledger.topup(db, user, 100, "held") is True
        assert db.writer == f"127.0.0.1:{b.port}" and db.health.retries["commit_unknown"] == 1
        assert await _journal(db, user) == (1, 100)


async def test_work_waiting_for_a_connection_when_the_writer_dies_goes_on_on_the_next(
    migrated: str, two: tuple[MySQLProxy, MySQLProxy]
) -> None:
    """Every connection of the pool held, a third transaction waiting for one; the node dies. The waiter
    does not wait forever on the old pool: within its statement timeout it runs on the next node."""
    a, b = two
    async with _through(migrated, two, 2, 2.0) as db:
        user = await ledger.create_user(db, "waiter")
        holding = asyncio.Event()
        release = asyncio.Event()
        held = 0

        async def hold(tx: Tx) -> bool:
            nonlocal held
            await tx.fetchone("SELECT 1")
            held += 1
            if held == 2:
                holding.set()
            await release.wait()
            return await journal.post(tx, user, 100, "topup", f"hold{held}-{tx.token}")

        holders = [asyncio.create_task(db.run(hold, idempotent=True)) for _ in range(2)]
        await holding.wait()
        waiter = asyncio.create_task(ledger.topup(db, user, 100, "waiter"))
        await eventually(lambda: db.connections_in_use() == 2, 10)
        a.go_down()
        release.set()
        assert await asyncio.wait_for(waiter, 60) is True
        for h in holders:
            await h
        assert db.writer == f"127.0.0.1:{b.port}"
        count, _ = await _journal(db, user)
        assert count >= 3  # the waiter's, and each holder's run that committed


async def test_a_process_started_after_a_failover_joins_the_others_and_a_told_one_takes_them_back(
    migrated: str, two: tuple[MySQLProxy, MySQLProxy]
) -> None:
    a, b = two
    url = _url(migrated, a.port, b.port)
    first = await connect(url, 2)
    try:
        user = await ledger.create_user(first, "joins")
        a.go_down()
        assert await ledger.topup(first, user, 100, "moved")
        assert first.writer == f"127.0.0.1:{b.port}"
        a.restore()
        later = await connect(url, 2)  # the first node answers again: it still joins the other
        try:
            assert later.writer == f"127.0.0.1:{b.port}"
        finally:
            await later.close()
        assert await first.reset_writer() == f"127.0.0.1:{a.port}"  # told: back, and says so
        again = await connect(url, 2)
        try:
            assert again.writer == f"127.0.0.1:{a.port}"
        finally:
            await again.close()
    finally:
        await first.close()


async def test_the_callers_own_errors_inside_a_transaction_pass_through_unchanged(
    migrated: str, two: tuple[MySQLProxy, MySQLProxy]
) -> None:
    async with _through(migrated, two, 2) as db:
        for mine in (RuntimeError("mine"), TimeoutError("mine"), ConnectionResetError("mine")):

            async def work(tx: Tx, e: BaseException = mine) -> None:
                await tx.fetchone("SELECT 1")
                raise e

            with pytest.raises(type(mine)) as raised:
                await db.run(work, idempotent=True)
            assert raised.value is mine and db.health.failovers == 0


async def test_a_pool_busy_past_the_timeout_is_a_loaded_process_not_a_lost_node(
    migrated: str, two: tuple[MySQLProxy, MySQLProxy]
) -> None:
    """Its one connection held by a long transaction: another's wait for it outlives the timeout, is run
    again ("busy") and goes through when the connection is free — the writer is not looked at or left."""
    async with _through(migrated, two, 1, 1.0) as db:
        user = await ledger.create_user(db, "busy")
        holding, release = asyncio.Event(), asyncio.Event()

        async def hold(tx: Tx) -> None:
            await tx.fetchone("SELECT 1")
            holding.set()
            await release.wait()

        holder = asyncio.create_task(db.run(hold, idempotent=True))
        await holding.wait()
        waiter = asyncio.create_task(ledger.topup(db, user, 100, "busy"))
        await eventually(lambda: db.health.retries["busy"] >= 1, 30)
        release.set()
        await holder
        assert await asyncio.wait_for(waiter, 60) is True
        assert db.health.failovers == 0 and db.writer == f"127.0.0.1:{two[0].port}"
