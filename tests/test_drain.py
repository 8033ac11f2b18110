"""The credit drain: hundreds of queued credits per batch, claimed with short leases that a dead worker's
replacement takes over within seconds."""

from __future__ import annotations

import asyncio
import time

from server import keys, ledger, packets
from server.core import Core
from server.ledger import now_ms
from server.reconcile import reconcile
from tests.conftest import make_world
from tests.hubtools import eventually
from tests.test_credit import assert_books_balance, queued, run_worker
from worker.drain import CreditDrain


async def _storm(core: Core, members: int) -> dict[int, int]:
    w = await make_world(core, members=members, admin_cents=100_000)
    p = await packets.send_packet(core, w.admin, w.group, "lucky", members * 100, members)
    results = await asyncio.gather(*(packets.grab(core, p.packet_id, w.group, u) for u in w.members))
    return {r.grab.user_id: r.grab.amount for r in results}


async def _claimed(core: Core) -> list[str]:
    return [e.decode() for e in await core.redis.zrange(keys.credit_claims(core.settings.queue_name), 0, -1)]


async def test_the_drain_pays_a_storm_in_big_batches(core: Core) -> None:
    told = await _storm(core, 100)
    drain = CreditDrain(core, batch=60)
    assert await drain.until_empty() == 100
    assert sum(b.get() for b in drain.metrics.batch_size._buckets) == 2  # 60 + 40
    for user, amount in told.items():
        assert await ledger.balance(core.db, user) == amount
    assert await queued(core) == {} and await _claimed(core) == []
    # Marked paid in the packet's own keys: a repeat grab queues nothing again.
    pid = int((await core.db.fetchone("SELECT MAX(id) FROM red_packets"))[0])  # type: ignore[index]
    assert await core.redis.scard(keys.packet_paid(pid)) == 100
    assert await run_worker(core) == 0
    assert (await reconcile(core.db)).ok
    await assert_books_balance(core)


async def test_two_drains_share_the_queue_without_paying_anything_twice(core: Core) -> None:
    told = await _storm(core, 80)
    a, b = CreditDrain(core, batch=20), CreditDrain(core, batch=20)
    await asyncio.gather(a.until_empty(), b.until_empty())
    assert a.processed + b.processed == 80 and a.credited + b.credited == 80
    for user, amount in told.items():
        assert await ledger.balance(core.db, user) == amount
    rows = await core.db.fetchone("SELECT COUNT(*) FROM journal WHERE kind = 'grab'")
    assert rows is not None and int(rows[0]) == 80
    assert (await reconcile(core.db)).ok


async def test_claims_of_a_dead_drain_lapse_and_another_takes_them_over(core: Core) -> None:
    told = await _storm(core, 30)
    # A drain claims every credit with a short lease, then dies before paying (no release, no renewal).
    dead = CreditDrain(core, lease_ms=300)
    taken = await dead._claim()
    assert taken is not None and len(taken.entries) == 30 and await queued(core) == {}
    alive = CreditDrain(core)
    assert await alive.until_empty() == 0  # held: not yet anyone else's
    started = time.monotonic()
    # Once the lease lapses the next claim puts them back and pays them: wait for that, bounded.
    await eventually(lambda: _pays(alive, 30), timeout=30)
    assert time.monotonic() - started < 30
    assert sum([await ledger.balance(core.db, u) for u in told]) == sum(told.values())
    assert await _claimed(core) == []


async def _pays(drain: CreditDrain, total: int) -> bool:
    await drain.until_empty()
    return drain.credited == total


async def test_a_live_drain_renews_its_leases_while_it_pays(core: Core) -> None:
    await _storm(core, 10)
    drain = CreditDrain(core, lease_ms=400)
    taken = await drain._claim()
    assert taken is not None
    renewer = asyncio.ensure_future(drain._renew_leases())
    try:
        first = now_ms()
        # However long the database takes, the claims stay ahead of the clock while the drain lives.
        await eventually(lambda: _renewed_past(core, first + 400), timeout=10)
        other = CreditDrain(core)
        assert await other._claim() is None  # nothing lapsed, nothing to take
    finally:
        renewer.cancel()
    outcomes = await drain._pay(taken)
    await drain._finish(taken, outcomes)
    assert drain.credited == 10 and await _claimed(core) == []


async def _renewed_past(core: Core, ms: int) -> bool:
    rows = await core.redis.zrange(keys.credit_claims(core.settings.queue_name), 0, -1, withscores=True)
    return bool(rows) and min(score for _, score in rows) > ms


async def test_a_batch_that_fails_before_commit_is_given_back(core: Core) -> None:
    await _storm(core, 5)
    drain = CreditDrain(core)
    taken = await drain._claim()
    assert taken is not None
    await drain._release(taken)
    assert len(await queued(core)) == 5 and await _claimed(core) == []
    assert await CreditDrain(core).until_empty() == 5
