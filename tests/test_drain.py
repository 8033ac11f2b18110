"""The credit drain: the shards' outboxes read as one consumer group, hundreds of credits per batch,
acknowledged after the commit; a dead worker's entries taken over within seconds."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from redis.exceptions import ResponseError

from server.core import Core
from server.money import grabs, groups, ledger, packets
from server.money.reconcile import reconcile
from server.store import keys
from server.store.db import DatabaseError
from tests.books import assert_books_balance, run_worker
from tests.conftest import make_world, outbox
from tests.dbproxy import core_behind_proxy
from tests.hubtools import eventually
from worker.drain import CreditDrain


async def _storm(core: Core, members: int) -> tuple[int, dict[int, int]]:
    w = await make_world(core, members=members, admin_cents=100_000)
    p = await packets.send_packet(
        core, sender_id=w.admin, group_id=w.group, kind="lucky", total=members * 100, count=members
    )
    results = await asyncio.gather(
        *(grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=u) for u in w.members)
    )
    return w.group, {r.grab.user_id: r.grab.amount for r in results}


async def _pending(core: Core, group: int) -> int:
    try:
        info = await core.redis.xpending(keys.outbox_for(group), keys.CREDIT_GROUP)
    except ResponseError:  # NOGROUP: no drain has read this outbox yet
        return 0
    return int(info["pending"])


async def test_the_drain_pays_a_storm_in_big_batches(core: Core) -> None:
    group, told = await _storm(core, 100)
    drain = CreditDrain(core, batch=60)
    assert await drain.until_empty() == 100
    assert sum(b.get() for b in drain.metrics.batch_size._buckets) == 2  # 60 + 40
    for user, amount in told.items():
        assert await ledger.balance(core.db, user) == amount
    assert await outbox(core, group) == [] and await _pending(core, group) == 0
    assert await run_worker(core) == 0
    assert (await reconcile(core)).ok
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
    assert (await reconcile(core)).ok


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


async def test_a_slow_payment_keeps_its_hold_and_pays_once(core: Core) -> None:
    """A payment held up in the database (the packet's row locked by someone else) for as long as it
    takes: the paying drain renews its hold, so another drain looking for idle entries finds none; once
    the lock goes, the grabs are paid, once."""
    group, told = await _storm(core, 10)
    pid = await _last_packet(core)
    locked, release = asyncio.Event(), asyncio.Event()

    async def hold_the_packet() -> None:
        async with core.db.transaction() as tx:
            await tx.fetchone("SELECT id FROM red_packets WHERE id = %s" + tx.dialect.for_update, (pid,))
            locked.set()
            await release.wait()

    holder = asyncio.create_task(hold_the_packet())
    await locked.wait()
    lease = 600
    slow = CreditDrain(core, lease_ms=lease, consumer="slow")
    paying = asyncio.create_task(slow.until_empty())
    try:
        await eventually(lambda: _pending_is(core, group, 10), timeout=30)  # read, now paying
        other = CreditDrain(core, lease_ms=lease, consumer="other")
        idle = [await _idle(core, group)]

        async def renewed() -> bool:
            """The hold was renewed since the last look: the entries' idle time went down."""
            now = await _idle(core, group)
            went_down = now < idle[0]
            idle[0] = now
            return went_down

        started = time.monotonic()
        renewals = 0
        # Held for longer than a lease, renewed all along: another drain's look for idle entries (those
        # idle past the lease) finds none each time.
        while renewals < 3 or time.monotonic() - started < 2 * lease / 1000:
            await eventually(renewed, timeout=30)
            renewals += 1
            batch = await other._read()
            assert batch is None or not batch.items
            other._last_takeover = 0.0
        assert not paying.done() and sum([await ledger.balance(core.db, u) for u in told]) == 0
    finally:
        release.set()
        await holder
    assert await paying == 10
    for user, amount in told.items():
        assert await ledger.balance(core.db, user) == amount
    assert await _pending(core, group) == 0
    assert (await reconcile(core)).ok


async def _last_packet(core: Core) -> int:
    row = await core.db.fetchone("SELECT MAX(id) FROM red_packets")
    assert row is not None
    return int(row[0])


async def _idle(core: Core, group: int) -> int:
    """How long the longest-idle pending entry of the group's outbox has been idle (ms)."""
    rows = await core.redis.xpending_range(keys.outbox_for(group), keys.CREDIT_GROUP, "-", "+", 100)
    return max((int(r["time_since_delivered"]) for r in rows), default=0)


async def _pending_is(core: Core, group: int, n: int) -> bool:
    return await _pending(core, group) == n


@pytest.mark.parametrize("core", ["mysql"], indirect=True)
async def test_a_batch_whose_payment_fails_is_given_back_at_once(core: Core) -> None:
    """The database goes away in the middle of a batch (a connection cut at its first insert, new ones
    refused): nothing of it commits, its entries are given back marked long idle, and the next drain
    pays them at its first look, without waiting out a lease."""
    async with core_behind_proxy(core) as (c, proxy):
        group, told = await _storm(c, 5)
        failing = CreditDrain(c, consumer="failing")
        proxy.cut_at(b"INSERT INTO grab_records")
        with pytest.raises(DatabaseError):
            await failing.until_empty()
        assert proxy.refusing  # it failed where it was made to
        rows = await c.redis.xpending_range(keys.outbox_for(group), keys.CREDIT_GROUP, "-", "+", 100)
        assert len(rows) == 5 and min(int(r["time_since_delivered"]) for r in rows) >= failing.lease_ms
        proxy.restore()
        started = time.monotonic()
        assert await CreditDrain(c, consumer="next").until_empty() == 5
        assert time.monotonic() - started < failing.lease_ms / 1000
        for user, amount in told.items():
            assert await ledger.balance(c.db, user) == amount
        assert (await reconcile(c)).ok


async def _idle_below(core: Core, group: int, ms: int) -> bool:
    rows = await core.redis.xpending_range(keys.outbox_for(group), keys.CREDIT_GROUP, "-", "+", 100)
    return bool(rows) and max(int(r["time_since_delivered"]) for r in rows) < ms


async def test_a_read_that_fails_on_one_shard_gives_back_what_the_others_gave(
    core: Core, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One master fails a read (away, or its durability wait fell short) while the others answer: the
    drain gives their entries back at once instead of holding (and renewing) them unpaid."""
    w = await make_world(core, members=5, admin_cents=100_000)
    group = w.group
    if keys.shard(group) == keys.SHARDS - 1:  # the failing shard must come after the packet's
        group = await groups.create_group(core.db, w.admin, "next")
        await groups.add_members(core.db, core.membership, group, w.members)
    p = await packets.send_packet(core, sender_id=w.admin, group_id=group, kind="lucky", total=500, count=5)
    told = {
        u: (await grabs.grab(core, packet_id=p.packet_id, group_id=group, user_id=u)).grab.amount
        for u in w.members
    }
    drain = CreditDrain(core, consumer="partial")
    await drain._make_groups()
    real = drain._each_shard

    async def one_shard_fails(
        command: Any, shards: list[int] | None = None, durable: bool = False
    ) -> list[Any]:
        answers = await real(command, shards, durable)
        if shards is None:  # a read of every shard: the last one fails, after the packet's answered
            answers[-1] = ConnectionError("a master away")
        return answers

    monkeypatch.setattr(drain, "_each_shard", one_shard_fails)
    with pytest.raises(ConnectionError):
        await drain._read()
    monkeypatch.undo()
    assert not any(drain.holding.values())  # nothing left to be renewed
    assert (
        min(
            [
                int(r["time_since_delivered"])
                for r in await core.redis.xpending_range(
                    keys.outbox_for(group), keys.CREDIT_GROUP, "-", "+", 100
                )
            ]
        )
        >= drain.lease_ms
    )  # given back: idle past the lease
    assert await CreditDrain(core, consumer="next").until_empty() == 5
    for user, amount in told.items():
        assert await ledger.balance(core.db, user) == amount


async def test_an_acknowledgement_lost_as_redis_goes_leaves_no_entry_held_for_ever(
    core: Core, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis goes away between a batch's payment and its acknowledgement, while the next batch has been
    read ahead: the acknowledgement fails. Every entry must still be paid by a later look — none may stay
    held (its lease renewed) by a renewer the failure left running. (Seen in `up` with its Valkey killed:
    six grabs told "won" stayed pending under the live worker, renewed, unpaid, until it restarted.)"""
    group, told = await _storm(core, 3)
    real_finish = CreditDrain._finish
    failed: list[int] = []

    async def finish_failing_once(self: CreditDrain, taken: Any, outcomes: Any) -> None:
        if not failed:
            failed.append(len(taken))
            raise ConnectionError("Redis went away before the acknowledgement")
        await real_finish(self, taken, outcomes)

    monkeypatch.setattr(CreditDrain, "_finish", finish_failing_once)
    drain = CreditDrain(core, batch=1, lease_ms=300)  # one credit a batch: the next one is read ahead
    running = asyncio.create_task(drain.run(idle_sleep=0.01))
    try:
        # The state: the acknowledgement failed with a batch paid and another read ahead.
        await eventually(lambda: bool(failed), timeout=30)

        # Every grab paid, and nothing left pending or held. (Held is the drain's own note, cleared once
        # the acknowledgement's answer is back: after Redis says nothing is pending, on a loaded machine.)
        async def settled() -> bool:
            balances = [await ledger.balance(core.db, u) for u in told]
            paid = balances == list(told.values()) and await _pending(core, group) == 0
            return paid and not any(drain.holding.values())

        await eventually(settled, timeout=30)
    finally:
        running.cancel()
        await asyncio.wait([running])
    assert (await reconcile(core)).ok


async def test_an_outcome_the_drain_does_not_know_acknowledges_nothing(core: Core) -> None:
    """Before: ``_finish`` took any outcome it did not recognise for a refusal and acknowledged its entry:
    a new or misspelt outcome dropped a credit from Redis with no payment and no refusal row. Now the
    outcome is a closed type matched by name, and an unknown one stops the batch before any ack."""
    group, _ = await _storm(core, 3)
    drain = CreditDrain(core)
    await drain._make_groups()
    taken = await drain._read()
    assert taken is not None and len(taken) == 3 and await _pending(core, group) == 3
    misspelt: list[Any] = ["credited", "credted", "already"]  # (mypy refuses it typed as an Outcome)
    with pytest.raises(AssertionError):
        await drain._finish(taken, misspelt)
    assert await _pending(core, group) == 3  # nothing acknowledged
    rows = await core.db.fetchone("SELECT COUNT(*) FROM credit_refusals")
    assert rows is not None and int(rows[0]) == 0
    assert not any(drain.holding.values())  # given back, not renewed: another drain takes them at once
    assert await CreditDrain(core, consumer="knows-better").until_empty() == 3
    assert await _pending(core, group) == 0 and (await reconcile(core)).ok
