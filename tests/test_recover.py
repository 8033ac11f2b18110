"""Recovery from the database when Redis lost a packet: never a share twice, never past the total."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from server import errors
from server.core import Core, open_core
from server.errors import RedPacketError
from server.money import grabs, ledger, packets
from server.money.reconcile import reconcile
from server.store import keys
from server.store.db import Tx
from server.store.records import GrabRecord
from server.store.redisconn import ServerChanged
from tests.books import assert_books_balance, run_worker
from tests.conftest import make_world, outbox
from tests.hubtools import eventually
from tests.redisproc import needs_redis_server, redis_process
from worker.drain import Batch, CreditDrain


async def _paid(core: Core, packet_id: int) -> tuple[int, int, int]:
    row = await core.db.fetchone(
        "SELECT COALESCE(SUM(amount), 0), COUNT(*), COUNT(DISTINCT seq)"
        " FROM grab_records WHERE packet_id = %s",
        (packet_id,),
    )
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


async def test_keys_lost_half_way_then_recovered_and_grabbing_goes_on(core: Core) -> None:
    w = await make_world(core, members=10, admin_cents=50_000)
    p = await packets.send_packet(
        core, sender_id=w.admin, group_id=w.group, kind="lucky", total=5_000, count=10
    )
    first = [
        await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=u) for u in w.members[:5]
    ]
    assert await run_worker(core) == 5
    await core.redis.delete(*keys.packet_keys(group_id=w.group, packet_id=p.packet_id))

    # The next grab finds the packet gone from Redis and brings it back from the database.
    nxt = await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=w.members[5])
    assert nxt.outcome == "won" and nxt.remaining == 4
    # Recovering again, any number of times, changes nothing.
    again = await packets.recover_packet(core, p.packet_id)
    assert (again.shares_left, again.grabs_known) == (4, 6)
    rest = [await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=u) for u in w.members[6:]]
    # Earlier grabbers still get their own share back, not a new one.
    for r in first:
        back = await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=r.grab.user_id)
        assert back.outcome == "already" and back.grab.seq == r.grab.seq and back.grab.amount == r.grab.amount
    seqs = [r.grab.seq for r in [*first, nxt, *rest]]
    assert sorted(seqs) == list(range(1, 11))
    assert await run_worker(core) == 5
    assert await _paid(core, p.packet_id) == (5_000, 10, 10)
    await assert_books_balance(core)


async def test_recover_racing_a_grab_storm(core: Core) -> None:
    w = await make_world(core, members=60, admin_cents=50_000)
    p = await packets.send_packet(
        core, sender_id=w.admin, group_id=w.group, kind="lucky", total=10_000, count=50
    )
    takes = [grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=u) for u in w.members]
    recovers = [packets.recover_packet(core, p.packet_id) for _ in range(20)]
    mixed = [x for pair in zip(takes[:20], recovers, strict=True) for x in pair] + takes[20:]
    results = await asyncio.gather(*mixed, return_exceptions=True)
    won = [r for r in results if isinstance(r, grabs.GrabResult)]
    assert len(won) == 50 and len({r.grab.seq for r in won}) == 50
    assert sum(r.grab.amount for r in won) == 10_000
    assert await run_worker(core) == 50
    assert await _paid(core, p.packet_id) == (10_000, 50, 50)


async def test_grabs_still_queued_for_credit_keep_their_share_through_recovery(core: Core) -> None:
    """Only the packet's keys are lost; the credit queue survived. The grabbers who were told they won
    keep their share and are paid; nobody else is handed it."""
    w = await make_world(core, members=8, admin_cents=50_000)
    p = await packets.send_packet(
        core, sender_id=w.admin, group_id=w.group, kind="lucky", total=4_000, count=4
    )
    told = {}
    for u in w.members[:2]:
        told[u] = (await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=u)).grab.amount
    await core.redis.delete(*keys.packet_keys(group_id=w.group, packet_id=p.packet_id))
    for u in w.members[2:]:
        try:
            told[u] = (await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=u)).grab.amount
        except RedPacketError as e:
            assert e.code == errors.PACKET_EMPTY, e  # the two queued shares were not handed out again
    assert len(told) == 4 and sum(told.values()) == 4_000
    await run_worker(core)
    for u in w.members:
        assert await ledger.balance(core.db, u) == told.get(u, 0)
    assert await _paid(core, p.packet_id) == (4_000, 4, 4)
    await assert_books_balance(core)


async def test_grabs_lost_with_the_whole_redis_never_overpay(core: Core) -> None:
    """The worst case: Redis loses grabs that were never credited, and their queued jobs with them
    (no AOF, or the last second before a crash). Their shares come back and are grabbed again; the
    database's unique keys still pay each share once and never past the total."""
    w = await make_world(core, members=8, admin_cents=50_000)
    p = await packets.send_packet(
        core, sender_id=w.admin, group_id=w.group, kind="lucky", total=4_000, count=4
    )
    for u in w.members[:2]:
        await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=u)
    await core.redis.flushdb()
    refused = []
    for u in w.members[2:]:
        try:
            await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=u)
        except RedPacketError as e:
            refused.append(e.code)
    assert refused == [errors.PACKET_EMPTY] * 2  # four shares, six grabbers: two too many, said as such
    await run_worker(core)
    paid, paid_grabs, seqs = await _paid(core, p.packet_id)
    assert paid == 4_000 and paid_grabs == seqs == 4
    balances = sum([await ledger.balance(core.db, u) for u in w.members])
    assert balances == 4_000
    await assert_books_balance(core)


@pytest.mark.parametrize("guard", ["on", "off"])
async def test_a_repair_racing_the_drain_never_hands_a_paid_share_out_again(
    core: Core, guard: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The packet's keys are gone; user A's grab of a share waits in the outbox. A repair of the packet
    and a drain paying that grab run at once. The drain may not commit between the repair's reads (it
    waits on the packet's row lock), and the repair reads the outbox before the database: A keeps the
    share. ``off`` is the hole: the database read first and no lock, the drain committing and
    acknowledging in between — the share goes back, user B is told "won" for it, the credit is refused,
    and reconciliation says so."""
    if guard == "off" and core.db.dialect.name == "sqlite":
        pytest.skip("SQLite has one writer: a drain cannot commit inside the repair's transaction")
    w = await make_world(core, members=4, admin_cents=50_000)
    p = await packets.send_packet(
        core, sender_id=w.admin, group_id=w.group, kind="lucky", total=4_000, count=4
    )
    a, b = w.members[:2]
    mine = (await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=a)).grab
    await core.redis.delete(*keys.packet_keys(group_id=w.group, packet_id=p.packet_id)[:3])
    assert len(await outbox(core, w.group)) == 1
    drain = CreditDrain(core)
    draining: list[asyncio.Task[int]] = []
    real_taken = packets._taken

    async def taken_while_draining(c: Core, tx: Tx, q: packets.Packet) -> dict[int, GrabRecord]:
        # The drain starts right here, inside the repair's transaction: on the fixed path it then waits
        # for the packet's lock until the repair is done (seen waiting on MariaDB; on SQLite it waits
        # for the one writer's lock, which is not to be seen from here).
        draining.append(asyncio.create_task(drain.until_empty()))
        if c.db.dialect.name == "mysql":
            await eventually(lambda: _paid_or_waiting(c, q.packet_id), timeout=30)
        return await real_taken(c, tx, q)

    async def taken_old_order(c: Core, tx: Tx, q: packets.Packet) -> dict[int, GrabRecord]:
        # The hole: the database read first, then a drain commits and acknowledges, then the outbox.
        rows = await tx.fetchall(
            "SELECT user_id, seq, amount, grabbed_ms FROM grab_records WHERE packet_id = %s", (q.packet_id,)
        )
        async with open_core(c.settings) as other:  # the worker: another process, its own connections
            assert await CreditDrain(other).until_empty() == 1
        known = {int(r[0]): GrabRecord(int(r[1]), int(r[2]), int(r[3])) for r in rows}
        for queued in await packets._queued(c, q):
            known.setdefault(queued.user_id, queued.record)
        return known

    async def unlocked(tx: Tx, packet_id: int) -> packets.Packet:
        row = await tx.fetchone(
            f"SELECT {packets.PACKET_COLUMNS} FROM red_packets WHERE id = %s", (packet_id,)
        )
        assert row is not None
        return packets.packet_from_row(row)

    if guard == "on":
        monkeypatch.setattr(packets, "_taken", taken_while_draining)
    else:
        monkeypatch.setattr(packets, "_taken", taken_old_order)
        monkeypatch.setattr(packets, "_locked", unlocked)
    await packets.recover_packet(core, p.packet_id)
    for t in draining:
        await t
    assert await ledger.balance(core.db, a) == mine.amount  # paid, whichever way
    theirs = (await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=b)).grab
    await run_worker(core)
    report = await reconcile(core)
    if guard == "off":
        assert theirs.seq == mine.seq  # handed out twice
        assert await ledger.balance(core.db, b) == 0
        assert "credit_refused" in report.checks(), report.differences
        return
    assert theirs.seq != mine.seq
    assert await ledger.balance(core.db, b) == theirs.amount
    assert report.ok, report.differences
    await assert_books_balance(core)


@needs_redis_server
@pytest.mark.parametrize("core", ["mysql"], indirect=True)
@pytest.mark.parametrize("guard", ["on", "off"])
async def test_a_credit_in_flight_when_redis_lost_its_grab_keeps_its_share(
    core: Core, tmp_path: Path, guard: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Durability none. A is told "won" a share; a worker reads its credit and is paying it when Redis
    crashes (an OS crash: the server never fsynced, it comes back empty), and a repair rebuilds the
    packet from the database, which has not got A's credit yet. The payment waits for the packet's row
    lock until the repair has loaded Redis, then commits, and its acknowledgement takes the share out of
    the list again and gives it back to A: X, grabbing after that, is not told it. (Between the repair
    and the acknowledgement — milliseconds — the share is in the list: a grab then gets it, its credit
    is refused and reconciliation reports it.) ``off``: without the lock the payment commits between
    the repair's read and its load, the repair puts the share back, and X is handed it."""
    if guard == "off":
        monkeypatch.setattr(packets, "_locked", _unlocked)
    async with redis_process(tmp_path, "--appendfsync", "no", fsyncs=tmp_path / "fsyncs") as r:
        async with open_core(core.settings.replace(redis_url=r.url, grab_durability="none")) as c:
            w = await make_world(c, members=4, admin_cents=10_000)
            p = await packets.send_packet(
                c, sender_id=w.admin, group_id=w.group, kind="lucky", total=1_000, count=4
            )
            a, x = w.members[:2]
            mine = (await grabs.grab(c, packet_id=p.packet_id, group_id=w.group, user_id=a)).grab
            drain = CreditDrain(c, consumer="paying")
            await drain._make_groups()
            taken = await drain._read()
            assert taken is not None and [credit.user_id for _, _, credit in taken.items] == [a]
            assert await r.os_crash() > 0  # the packet, the grab and its credit: all gone from Redis
            await r.start()
            paying: list[asyncio.Task[None]] = []
            real_taken = packets._taken

            async def taken_then_pay(cc: Core, tx: Tx, q: packets.Packet) -> dict[int, GrabRecord]:
                held = await real_taken(cc, tx, q)
                assert a not in {g[0] for g in held}  # the repair's read: A's credit not in it yet
                paying.append(asyncio.create_task(_pay(drain, taken)))
                await eventually(lambda: _paid_or_waiting(c, p.packet_id), timeout=30)
                if guard == "off":
                    # Paid and acknowledged before the repair loads Redis, always: an acknowledgement
                    # that came after the load would take the share back out by luck (1 run in 10).
                    await paying[0]
                return held

            monkeypatch.setattr(packets, "_taken", taken_then_pay)
            await _recover(c, p.packet_id)
            monkeypatch.setattr(packets, "_taken", real_taken)
            await paying[0]
            assert await ledger.balance(c.db, a) == mine.amount  # A is paid as told, either way
            theirs = (await grabs.grab(c, packet_id=p.packet_id, group_id=w.group, user_id=x)).grab
            await CreditDrain(c).until_empty()
            report = await reconcile(c)
            if guard == "off":
                assert theirs.seq == mine.seq  # handed out again
                assert "credit_refused" in report.checks(), report.differences
                return
            assert theirs.seq != mine.seq
            again = await grabs.grab(c, packet_id=p.packet_id, group_id=w.group, user_id=a)
            assert again.outcome == "already" and again.grab.seq == mine.seq
            assert await ledger.balance(c.db, x) == theirs.amount
            assert report.ok, report.differences


async def _unlocked(tx: Tx, packet_id: int) -> packets.Packet:
    """The hole: the packet read without its row lock."""
    row = await tx.fetchone(f"SELECT {packets.PACKET_COLUMNS} FROM red_packets WHERE id = %s", (packet_id,))
    assert row is not None
    return packets.packet_from_row(row)


async def _pay(drain: CreditDrain, taken: Batch) -> None:
    await drain._finish(taken, await drain._pay(taken))


async def _paid_or_waiting(c: Core, packet_id: int) -> bool:
    """The payment committed, or it is waiting for the packet's row lock (its locking read is running:
    the repair holds the lock). (INNODB_TRX would say LOCK WAIT, but it is a cache that polling faster
    than every 0.1 s never lets refresh.)"""
    paid = await c.db.fetchone("SELECT COUNT(*) FROM grab_records WHERE packet_id = %s", (packet_id,))
    waiting = await c.db.fetchone(
        "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE COMMAND = 'Query'"
        # (The one-transaction batch's lock, or a shard-local credit's first step's.)
        " AND INFO LIKE 'SELECT id, status%% FROM red_packets WHERE id IN %% FOR UPDATE'"
    )
    return bool(paid and int(paid[0])) or bool(waiting and int(waiting[0]))


async def _recover(c: Core, packet_id: int) -> None:
    """recover_packet, once more if the first connection after the restart refused to be used."""
    try:
        await packets.recover_packet(c, packet_id)
    except ServerChanged:
        await packets.recover_packet(c, packet_id)
