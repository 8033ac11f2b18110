"""Batched crediting: many grabs per transaction, each paid exactly once, on both dialects."""

from __future__ import annotations

import asyncio

from server import errors
from server.core import Core
from server.money import grabs, ledger, packets
from server.money.crediting import credit_many
from server.money.ledger import Credit
from server.money.reconcile import reconcile
from tests.conftest import make_world
from tests.test_credit import assert_books_balance
from worker.drain import CreditDrain


async def _grabs(core: Core, members: int, total: int) -> tuple[int, list[Credit], list[int]]:
    w = await make_world(core, members=members, admin_cents=100_000)
    p = await packets.send_packet(core, w.admin, w.group, "lucky", total, members)
    credits = []
    for u in w.members:
        g = (await grabs.grab(core, p.packet_id, w.group, u)).grab
        credits.append(Credit(p.packet_id, u, g.seq, g.amount, g.grabbed_ms))
    return p.packet_id, credits, w.members


async def test_a_mixed_batch_pays_each_share_once(core: Core) -> None:
    pid, credits, _ = await _grabs(core, 6, 6_000)
    first, second, third, *rest = credits
    await ledger.credit_grab(core.db, first)  # already paid one by one
    batch = [
        first,  # already
        second,
        second,  # the same grab twice in one batch
        Credit(pid, third.user_id, third.seq, third.amount + 1, third.grabbed_ms),  # not the pre-split amount
        Credit(pid, third.user_id, second.seq, second.amount, third.grabbed_ms),  # someone else's share
        *rest,
    ]
    outcomes = await credit_many(core.db, batch)
    assert outcomes == [
        "already",
        "credited",
        "already",
        errors.SHARE_CONFLICT,
        errors.SHARE_CONFLICT,
        *["credited"] * len(rest),
    ]
    for c in credits:
        expected = 0 if c is third else c.amount
        assert await ledger.balance(core.db, c.user_id) == expected
    # The refused one is paid when its true credit comes.
    assert await credit_many(core.db, [third]) == ["credited"]
    assert (await reconcile(core.db)).ok
    await assert_books_balance(core)


async def test_overlapping_batches_from_two_workers_pay_once(core: Core) -> None:
    _, credits, _ = await _grabs(core, 40, 20_000)
    a, b = credits[:30], credits[10:]
    results = await asyncio.gather(credit_many(core.db, a), credit_many(core.db, b), credit_many(core.db, a))
    credited = sum(r.count("credited") for r in results)
    assert credited == 40
    assert all(o in ("credited", "already") for r in results for o in r)
    total = sum([await ledger.balance(core.db, c.user_id) for c in credits])
    assert total == 20_000
    rows = await core.db.fetchone("SELECT COUNT(*) FROM journal WHERE kind = 'grab'")
    assert rows is not None and int(rows[0]) == 40
    await assert_books_balance(core)


async def test_the_worker_credits_a_storm_in_batches(core: Core) -> None:
    _, credits, _ = await _grabs(core, 100, 20_000)
    drain = CreditDrain(core, batch=30)
    assert await drain.until_empty() == 100 and drain.processed == 100
    metrics = drain.metrics
    assert metrics.credit_lag._sum.get() > 0
    assert sum(b.get() for b in metrics.credit_lag._buckets) == 100
    assert sum(b.get() for b in metrics.batch_size._buckets) == 4  # 30 + 30 + 30 + 10
    for c in credits:
        assert await ledger.balance(core.db, c.user_id) == c.amount
    assert (await reconcile(core.db)).ok
