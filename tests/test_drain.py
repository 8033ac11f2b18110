"""The credit drain: the shards' outboxes read as one consumer group, hundreds of credits per batch,
acknowledged after the commit; a dead worker's entries taken over within seconds."""

from __future__ import annotations

import asyncio
import time

from server.core import Core
from server.money import grabs, ledger, packets
from server.money.reconcile import reconcile
from server.store import keys
from tests.conftest import make_world, outbox
from tests.hubtools import eventually
from tests.test_credit import assert_books_balance, run_worker
from worker.drain import CreditDrain


async def _storm(core: Core, members: int) -> tuple[int, dict[int, int]]:
    w = await make_world(core, members=members, admin_cents=100_000)
    p = await packets.send_packet(core, w.admin, w.group, "lucky", members * 100, members)
    results = await asyncio.gather(*(grabs.grab(core, p.packet_id, w.group, u) for u in w.members))
    return w.group, {r.grab.user_id: r.grab.amount for r in results}


async def _pending(core: Core, group: int) -> int:
    info = await core.redis.xpending(keys.outbox_for(group), keys.CREDIT_GROUP)
    return int(info["pending"])


async def test_the_drain_pays_a_storm_in_big_batches(core: Core) -> None:
    group, told = await _storm(core, 100)
    drain = CreditDrain(core, batch=60)
    assert await drain.until_empty() == 100
    assert sum(b.get() for b in drain.metrics.batch_size._buckets) == 2  # 60 + 40
    for user, amount in told.items():
        assert await ledger.balance(core.db, user) == amount
    assert await outbox(core, group) == [] and await _pending(core, group) == 0
    pid = int((await core.db.fetchone("SELECT MAX(id) FROM red_packets"))[0])  # type: ignore[index]
    assert await core.redis.scard(keys.packet_paid(group, pid)) == 100  # marked paid beside the packet
    assert await run_worker(core) == 0
    assert (await reconcile(core.db)).ok
    await assert_books_balance(core)


async def test_two_drains_share_the_outboxes_without_paying_anything_twice(core: Core) -> None:
    _, told = await _storm(core, 80)
    a, b = CreditDrain(core, batch=20), CreditDrain(core, batch=20)
    await asyncio.gather(a.until_empty(), b.until_empty())
    assert a.processed + b.processed == 80 and a.credited + b.credited == 80
    for user, amount in told.items():
        assert await ledger.balance(core.db, user) == amount
    rows = await core.db.fetchone("SELECT COUNT(*) FROM journal WHERE kind = 'grab'")
    assert rows is not None and int(rows[0]) == 80
    assert (await reconcile(core.db)).ok


async def test_entries_of_a_dead_drain_fall_idle_and_another_takes_them_over(core: Core) -> None:
    group, told = await _storm(core, 30)
    # A drain reads every credit with a short lease, then dies before paying (no ack, no renewal).
    dead = CreditDrain(core, lease_ms=300, consumer="dead")
    await dead._make_groups()
    taken = await dead._read()
    assert taken is not None and len(taken) == 30 and await _pending(core, group) == 30
    alive = CreditDrain(core, lease_ms=300, consumer="alive")
    started = time.monotonic()
    # Once the entries have been idle longer than the lease, the next look takes them and pays them.
    await eventually(lambda: _pays(alive, 30), timeout=30)
    assert time.monotonic() - started < 30
    assert sum([await ledger.balance(core.db, u) for u in told]) == sum(told.values())
    assert await _pending(core, group) == 0 and await outbox(core, group) == []


async def _pays(drain: CreditDrain, total: int) -> bool:
    await drain.until_empty()
    return drain.credited == total


async def test_a_live_drain_renews_its_hold_while_it_pays(core: Core) -> None:
    group, _ = await _storm(core, 10)
    drain = CreditDrain(core, lease_ms=400, consumer="slow")
    await drain._make_groups()
    taken = await drain._read()
    assert taken is not None
    renewer = asyncio.ensure_future(drain._renew_leases())
    try:
        # However long the database takes, the entries never fall idle past the lease while it lives:
        # another drain looking for idle entries finds none, again and again.
        other = CreditDrain(core, lease_ms=400, consumer="other")
        for _ in range(5):
            await eventually(lambda: _idle_below(core, group, 400), timeout=30)
            batch = await other._read()
            assert batch is None or not batch.items
            other._last_takeover = 0.0
    finally:
        renewer.cancel()
    outcomes = await drain._pay(taken)
    await drain._finish(taken, outcomes)
    assert drain.credited == 10 and await _pending(core, group) == 0


async def _idle_below(core: Core, group: int, ms: int) -> bool:
    rows = await core.redis.xpending_range(keys.outbox_for(group), keys.CREDIT_GROUP, "-", "+", 100)
    return bool(rows) and max(int(r["time_since_delivered"]) for r in rows) < ms


async def test_a_batch_that_fails_before_commit_is_given_back_at_once(core: Core) -> None:
    group, _ = await _storm(core, 5)
    drain = CreditDrain(core, consumer="failing")
    await drain._make_groups()
    taken = await drain._read()
    assert taken is not None
    await drain._release(taken)
    # Marked long idle: the next drain's first look takes them over without waiting out a lease.
    assert await CreditDrain(core, consumer="next").until_empty() == 5
    assert await _pending(core, group) == 0
