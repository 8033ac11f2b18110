"""Recovery from the database when Redis lost a packet: never a share twice, never past the total."""

from __future__ import annotations

import asyncio

from server.core import Core
from server.errors import RedPacketError
from server.money import grabs, ledger, packets
from server.store import keys
from tests.conftest import make_world
from tests.test_credit import assert_books_balance, run_worker


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
    p = await packets.send_packet(core, w.admin, w.group, "lucky", 5_000, 10)
    first = [await grabs.grab(core, p.packet_id, w.group, u) for u in w.members[:5]]
    assert await run_worker(core) == 5
    await core.redis.delete(*keys.packet_keys(w.group, p.packet_id))

    # The next grab finds the packet gone from Redis and brings it back from the database.
    nxt = await grabs.grab(core, p.packet_id, w.group, w.members[5])
    assert nxt.outcome == "won" and nxt.remaining == 4
    # Recovering again, any number of times, changes nothing.
    again = await packets.recover_packet(core, p.packet_id)
    assert (again.shares_left, again.grabs_known) == (4, 6)
    rest = [await grabs.grab(core, p.packet_id, w.group, u) for u in w.members[6:]]
    # Earlier grabbers still get their own share back, not a new one.
    for r in first:
        back = await grabs.grab(core, p.packet_id, w.group, r.grab.user_id)
        assert back.outcome == "already" and back.grab.seq == r.grab.seq and back.grab.amount == r.grab.amount
    seqs = [r.grab.seq for r in [*first, nxt, *rest]]
    assert sorted(seqs) == list(range(1, 11))
    assert await run_worker(core) == 5
    assert await _paid(core, p.packet_id) == (5_000, 10, 10)
    await assert_books_balance(core)


async def test_recover_racing_a_grab_storm(core: Core) -> None:
    w = await make_world(core, members=60, admin_cents=50_000)
    p = await packets.send_packet(core, w.admin, w.group, "lucky", 10_000, 50)
    takes = [grabs.grab(core, p.packet_id, w.group, u) for u in w.members]
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
    p = await packets.send_packet(core, w.admin, w.group, "lucky", 4_000, 4)
    told = {}
    for u in w.members[:2]:
        told[u] = (await grabs.grab(core, p.packet_id, w.group, u)).grab.amount
    await core.redis.delete(*keys.packet_keys(w.group, p.packet_id))
    for u in w.members[2:]:
        try:
            told[u] = (await grabs.grab(core, p.packet_id, w.group, u)).grab.amount
        except RedPacketError:
            pass
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
    p = await packets.send_packet(core, w.admin, w.group, "lucky", 4_000, 4)
    for u in w.members[:2]:
        await grabs.grab(core, p.packet_id, w.group, u)
    await core.redis.flushdb()
    for u in w.members[2:]:
        try:
            await grabs.grab(core, p.packet_id, w.group, u)
        except RedPacketError:
            pass
    await run_worker(core)
    paid, paid_grabs, seqs = await _paid(core, p.packet_id)
    assert paid == 4_000 and paid_grabs == seqs == 4
    balances = sum([await ledger.balance(core.db, u) for u in w.members])
    assert balances == 4_000
    await assert_books_balance(core)
