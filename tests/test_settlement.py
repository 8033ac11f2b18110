"""Refunds, the sweeper and reconciliation, on both dialects. The clock is passed in, never slept on."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from server import errors
from server.core import Core, open_core
from server.errors import RedPacketError, Unavailable
from server.money import grabs, ledger, packets, settlement
from server.money.crediting import credit_many
from server.money.reconcile import reconcile
from server.settings import child_env
from server.store import keys
from server.store.records import CreditEntry
from tests.books import assert_books_balance, past_expiry, run_worker, set_paid_count
from tests.conftest import make_world, outbox, redis_pings
from tests.hubtools import eventually
from tests.redisproc import needs_redis_server, redis_process
from worker.drain import Batch, CreditDrain

T = TypeVar("T")


async def test_expired_packet_pays_its_grabs_then_refunds_the_rest(core: Core) -> None:
    w = await make_world(core, members=5, admin_cents=10_000)
    p = await packets.send_packet(
        core, sender_id=w.admin, group_id=w.group, kind="lucky", total=1_000, count=5
    )
    won = [await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=u) for u in w.members[:2]]
    taken = sum(g.grab.amount for g in won)
    # The credit jobs never ran: the refund itself settles the grabs first, so they are paid, not refunded.
    r = await settlement.refund_packet(core, p.packet_id, now=await past_expiry(core, p.packet_id))
    assert (r.outcome, r.amount) == ("refunded", 1_000 - taken)
    for g in won:
        assert await ledger.balance(core.db, g.grab.user_id) == g.grab.amount
    assert await ledger.balance(core.db, w.admin) == 10_000 - taken
    assert await core.redis.exists(*keys.packet_keys(group_id=w.group, packet_id=p.packet_id)) == 0
    # Its view (from the database now): ended by the refund, not emptied — no best luck, no time to
    # empty (they were given: the page then said nothing of the expiry), the shares left still said.
    view = await grabs.open_packet(core, packet_id=p.packet_id, group_id=w.group, user_id=w.members[0])
    assert view.finished_ms is not None and view.remaining == 3
    assert view.best_luck is None and view.duration_ms is None
    # Nothing more to grab, and a second refund pays nothing.
    try:
        await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=w.members[3])
        raise AssertionError("grab after refund")
    except RedPacketError as e:
        assert e.code in ("packet_expired", "packet_not_found")
    again = await settlement.refund_packet(core, p.packet_id, now=await past_expiry(core, p.packet_id))
    assert again.outcome == "taken"
    assert await run_worker(core) == 2  # the recorded credits are handled and pay nothing more
    report = await reconcile(core)
    assert report.ok, report.differences
    await assert_books_balance(core)


async def test_two_refunders_refund_once(core: Core) -> None:
    w = await make_world(core, members=2, admin_cents=10_000)
    p = await packets.send_packet(core, sender_id=w.admin, group_id=w.group, kind="lucky", total=900, count=2)
    await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=w.members[0])
    now = await past_expiry(core, p.packet_id)
    results = await asyncio.gather(*(settlement.refund_packet(core, p.packet_id, now=now) for _ in range(4)))
    assert [r.outcome for r in results].count("refunded") == 1
    rows = await core.db.fetchone("SELECT COUNT(*) FROM journal WHERE kind = 'refund'")
    assert rows is not None and int(rows[0]) == 1
    assert (await reconcile(core)).ok


async def test_a_packet_not_yet_due_is_left_alone(core: Core) -> None:
    w = await make_world(core, members=1, admin_cents=10_000)
    p = await packets.send_packet(core, sender_id=w.admin, group_id=w.group, kind="lucky", total=500, count=1)
    r = await settlement.refund_packet(core, p.packet_id)
    assert r.outcome == "not_due"
    assert await settlement.due_for_refund(core) == []
    assert (
        await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=w.members[0])
    ).outcome == "won"


async def test_an_emptied_packet_is_finished_not_refunded(core: Core) -> None:
    w = await make_world(core, members=2, admin_cents=10_000)
    p = await packets.send_packet(core, sender_id=w.admin, group_id=w.group, kind="equal", total=600, count=2)
    for u in w.members:
        await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=u)
    await run_worker(core)
    # Finished by the credit of its last share; the periodic catch-up finds nothing left to do.
    row = await core.db.fetchone("SELECT status FROM red_packets WHERE id = %s", (p.packet_id,))
    assert row is not None and row[0] == "finished"
    assert await settlement.mark_finished(core) == 0
    assert await settlement.due_for_refund(core, now=await past_expiry(core, p.packet_id)) == []
    refunds = await core.db.fetchone("SELECT COUNT(*) FROM journal WHERE kind = 'refund'")
    assert refunds is not None and int(refunds[0]) == 0
    assert (await reconcile(core)).ok


async def test_a_packet_whose_paid_count_an_older_process_missed_is_finished_by_the_catch_up(
    core: Core,
) -> None:
    """A worker from before migration 14, still running when it was applied, pays a share without raising
    the packet's count of shares paid: the last share's credit leaves the packet active with every share
    paid. The periodic catch-up (``mark_finished``) sets the count from the records and finishes it."""
    w = await make_world(core, members=2, admin_cents=10_000)
    p = await packets.send_packet(core, sender_id=w.admin, group_id=w.group, kind="lucky", total=200, count=2)
    gs = [
        (await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=u)).grab for u in w.members
    ]
    credits = [CreditEntry(p.packet_id, g.user_id, g.seq, g.amount, g.grabbed_ms) for g in gs]
    assert await credit_many(core.db, credits[:1]) == ["credited"]
    await set_paid_count(core, p.packet_id, 0)  # (the older worker's credit: not counted)
    assert await credit_many(core.db, credits[1:]) == ["credited"]
    status = "SELECT status, credited_count FROM red_packets WHERE id = %s"
    assert await core.db.fetchone(status, (p.packet_id,)) == ("active", 1)  # the dangerous state exists
    assert [d.check for d in (await reconcile(core)).differences] == ["packet_paid_count"]
    assert await settlement.mark_finished(core) == 1
    assert await core.db.fetchone(status, (p.packet_id,)) == ("finished", 2)
    assert await settlement.mark_finished(core) == 0
    assert (await reconcile(core)).ok


async def test_sweeper_pays_a_grab_whose_enqueue_was_lost(core: Core) -> None:
    w = await make_world(core, members=2, admin_cents=10_000)
    p = await packets.send_packet(core, sender_id=w.admin, group_id=w.group, kind="lucky", total=800, count=2)
    g = (await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=w.members[0])).grab
    # As if the credit job were lost (it expired unrun after a day, or Redis lost it): none exists.
    await core.redis.delete(keys.outbox_for(w.group))
    assert await run_worker(core) == 0
    assert await ledger.balance(core.db, w.members[0]) == 0
    # A younger grab is the drain's to pay (it may be on its way): the sweeper leaves it.
    assert (await settlement.sweep(core)).credited_now == 0
    swept = await settlement.sweep(core, now=ledger.now_ms() + settlement.STRANDED_MS)
    assert (swept.credited_now, swept.refused) == (1, 0)
    assert await ledger.balance(core.db, w.members[0]) == g.amount
    assert (await settlement.sweep(core)).credited_now == 0
    assert (await reconcile(core)).ok


async def test_reconciliation_finds_a_cent_out_of_place(core: Core) -> None:
    w = await make_world(core, members=2, admin_cents=10_000)
    p = await packets.send_packet(core, sender_id=w.admin, group_id=w.group, kind="lucky", total=700, count=2)
    await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=w.members[0])
    await run_worker(core)
    clean = await reconcile(core)
    assert clean.ok and clean.money_in == 10_000 and clean.held_in_packets > 0
    await core.db.run(
        lambda tx: tx.execute(
            "UPDATE accounts SET balance = balance + 1 WHERE user_id = %s", (w.members[1],)
        ),
        idempotent=False,
    )
    report = await reconcile(core)
    assert {d.check for d in report.differences} == {"account_journal", "global"}
    # The command prints the report and exits non-zero.
    env = child_env(
        REDPACKET_DATABASE_URL=core.settings.database_url, REDPACKET_REDIS_URL=core.settings.redis_url
    )
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "server", "reconcile"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and "DIFFERENCE account_journal" in done.stdout, done.stdout + done.stderr


async def test_the_periodic_jobs(core: Core) -> None:
    import dataclasses

    from worker.main import make_worker
    from worker.settle import Ctx, reconcile_job, refund_expired_job, sweep_job

    names = {c.name for c in make_worker(core).cron_jobs}
    assert {
        f"{core.namespace}:refund_expired_job",
        f"{core.namespace}:announce_job",
        f"{core.namespace}:sweep_job",
        f"{core.namespace}:reconcile_job",
        f"{core.namespace}:score_bots_job",
        f"{core.namespace}:expire_holds_job",
    } <= names
    w = await make_world(core, members=1, admin_cents=10_000)
    expired = dataclasses.replace(core, settings=core.settings.replace(packet_ttl_seconds=0))
    await packets.send_packet(expired, sender_id=w.admin, group_id=w.group, kind="lucky", total=400, count=1)
    ctx: Ctx = {"core": core}
    assert (await refund_expired_job(ctx)).get("refunded") == 1
    assert await ledger.balance(core.db, w.admin) == 10_000
    assert await sweep_job(ctx) == {"credited": 0, "refused": 0}
    assert await reconcile_job(ctx) == 0


async def test_reconciliation_while_money_moves_reports_no_false_difference(core: Core) -> None:
    """The figures are read in one consistent snapshot: top-ups and credits committed while a
    reconciliation reads are either all in its figures or all out (under load they made it report
    differences that were not there)."""
    w = await make_world(core, members=40, admin_cents=1_000_000)
    p = await packets.send_packet(
        core, sender_id=w.admin, group_id=w.group, kind="lucky", total=4_000, count=40
    )
    for m in w.members:
        await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=m)
    moving = True

    async def move_money() -> None:
        n = 0
        while moving:
            n += 1
            await ledger.topup(core.db, w.members[n % 40], 1, f"r{n}")

    mover = asyncio.create_task(move_money())
    crediting = asyncio.create_task(run_worker(core))
    try:
        reports = [await reconcile(core) for _ in range(30)]
    finally:
        moving = False
        await mover
        await crediting
    assert [r.differences for r in reports if not r.ok] == []
    assert (await reconcile(core)).ok


@needs_redis_server
@pytest.mark.parametrize("guard", ["on", "off"])
async def test_a_refund_waits_while_redis_is_unreachable(
    core: Core, tmp_path: Path, guard: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A grab was told "won"; its credit waits in the outbox; the packet expires while Redis is away. The
    refund must not pay the sender back from what the database alone says: it waits (``refunding``,
    nothing moved) until Redis answers, then pays the grab and refunds the rest. ``off`` is the hole: a
    refund that shrugs at Redis being away refunds everything, the credit is then refused — and
    reconciliation reports it."""
    if guard == "off":
        monkeypatch.setattr(settlement, "read_grabs", _blind(settlement.read_grabs, settlement.Seen([], [])))
        monkeypatch.setattr(settlement, "recover_packet", _blind(settlement.recover_packet, None))
    async with redis_process(tmp_path) as r:
        async with open_core(core.settings.replace(redis_url=r.url)) as c:
            w = await make_world(c, members=3, admin_cents=10_000)
            p = await packets.send_packet(
                c, sender_id=w.admin, group_id=w.group, kind="lucky", total=900, count=3
            )
            told = (await grabs.grab(c, packet_id=p.packet_id, group_id=w.group, user_id=w.members[0])).grab
            assert [e[1] for e in await outbox(c, w.group)] == [told.user_id]  # waiting to be paid
            await r.stop()  # a clean stop: its append-only file keeps the grab and its credit
            now = p.expires_ms + 1
            if guard == "on":
                with pytest.raises(Unavailable):
                    await settlement.refund_packet(c, p.packet_id, now=now)
                assert await _status(c, p.packet_id) == "refunding"
                assert await ledger.balance(c.db, w.admin) == 9_100
            else:
                assert (await settlement.refund_packet(c, p.packet_id, now=now)).amount == 900
            await r.start()
            await eventually(lambda: redis_pings(c), timeout=30)
            await CreditDrain(c).until_empty()
            again = await settlement.refund_packet(c, p.packet_id, now=now)
            report = await reconcile(c)
            if guard == "off":
                assert await ledger.balance(c.db, told.user_id) == 0
                assert "credit_refused" in report.checks(), report.differences
                return
            assert (again.outcome, again.amount) == ("refunded", 900 - told.amount)
            assert await ledger.balance(c.db, told.user_id) == told.amount
            assert await ledger.balance(c.db, w.admin) == 10_000 - told.amount
            assert report.ok, report.differences


def _blind(real: Callable[..., Awaitable[T]], instead: T) -> Callable[..., Awaitable[T]]:
    """``real``, with Redis being away ignored (what the refund did before it waited)."""

    async def blind(*args: Any, **kwargs: Any) -> T:
        try:
            return await real(*args, **kwargs)
        except RedPacketError:
            return instead

    return blind


async def _status(core: Core, packet_id: int) -> str:
    row = await core.db.fetchone("SELECT status FROM red_packets WHERE id = %s", (packet_id,))
    assert row is not None
    return str(row[0])


async def test_a_refund_closes_the_packet_even_when_the_workers_clock_is_ahead(
    core: Core, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker thinks the packet expired; Redis (whose clock grab.lua reads) does not yet. A grab that
    arrives while the refund settles (after it read the grabs, before it pays the sender back) is refused
    as expired: the refund closed the packet in Redis before it read them, so it is never told "won" for
    money the refund then gives back."""
    w = await make_world(core, members=3, admin_cents=10_000)
    p = await packets.send_packet(core, sender_id=w.admin, group_id=w.group, kind="lucky", total=900, count=3)
    before = (await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=w.members[0])).grab
    late: list[object] = []
    real_settle = settlement.settle

    async def settle_with_a_grab_arriving(
        c: Core, q: packets.Packet, seen: settlement.Seen
    ) -> settlement.Settled:
        try:
            late.append(await grabs.grab(c, packet_id=q.packet_id, group_id=w.group, user_id=w.members[1]))
        except RedPacketError as e:
            late.append(e.code)
        return await real_settle(c, q, seen)

    monkeypatch.setattr(settlement, "settle", settle_with_a_grab_arriving)
    r = await settlement.refund_packet(core, p.packet_id, now=p.expires_ms + 1)  # ahead of Redis by a day
    monkeypatch.undo()
    assert late == [errors.PACKET_EXPIRED]
    assert (r.outcome, r.amount) == ("refunded", 900 - before.amount)
    await run_worker(core)
    assert await ledger.balance(core.db, before.user_id) == before.amount
    assert await ledger.balance(core.db, w.members[1]) == 0
    assert (await reconcile(core)).ok


async def _five_packets_two_thirds_grabbed(
    core: Core,
) -> tuple[list[packets.Packet], dict[tuple[int, int], int]]:
    """Five packets of 3,000 in 30 shares, 20 of each grabbed (their credits in the outbox, unpaid): the
    packets, and what each grabber was told ((packet, user) -> amount)."""
    w = await make_world(core, members=30, admin_cents=100_000)
    told: dict[tuple[int, int], int] = {}
    sent = []
    for _ in range(5):
        p = await packets.send_packet(
            core, sender_id=w.admin, group_id=w.group, kind="lucky", total=3_000, count=30
        )
        sent.append(p)
        for u in w.members[:20]:
            told[(p.packet_id, u)] = (
                await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=u)
            ).grab.amount
    return sent, told


async def test_refunds_and_two_drains_at_once_pay_every_told_share_once(core: Core) -> None:
    """Packets expire with grabs still in the outbox; the refund job and two drains run at once, in
    whatever order the loop gives them (the orders themselves are made to happen in the next test).
    Each told share is paid once, the rest goes back, the books balance."""
    sent, told = await _five_packets_two_thirds_grabbed(core)
    now = max(p.expires_ms for p in sent) + 1
    a, b = CreditDrain(core, batch=7), CreditDrain(core, batch=11)
    results = await asyncio.gather(
        a.until_empty(),
        *(settlement.refund_packet(core, p.packet_id, now=now) for p in sent),
        b.until_empty(),
    )
    refunds = [r for r in results if isinstance(r, settlement.Refund)]
    assert all(r.outcome == "refunded" for r in refunds), refunds
    rows = await core.db.fetchall(
        "SELECT packet_id, user_id, amount FROM grab_records WHERE status = 'credited'"
    )
    assert {(int(p), int(u)): int(m) for p, u, m in rows} == told
    for p, r in zip(sent, refunds, strict=True):
        assert r.amount == 3_000 - sum(m for (pid, _), m in told.items() if pid == p.packet_id)
    assert await run_worker(core) == 0
    assert (await reconcile(core)).ok
    await assert_books_balance(core)


async def test_a_refund_and_a_drain_holding_the_same_credits_pay_each_once(core: Core) -> None:
    """Both orders, made to happen: a drain holds every credit of five expired packets. It pays two
    packets' credits; then the refunds run — for those two they find the grabs paid and give back the
    rest; for the other three they pay the grabs themselves (from Redis) first. Then the drain pays what
    it still holds: all already paid. Each told share once, the rest back to the sender, to the cent."""
    sent, told = await _five_packets_two_thirds_grabbed(core)
    drain = CreditDrain(core, batch=1_000, consumer="holding")
    await drain._make_groups()
    held = await drain._read()
    assert held is not None and len(held.items) == 100
    early = {p.packet_id for p in sent[:2]}
    first = Batch(items=[i for i in held.items if i[2].packet_id in early])
    second = Batch(items=[i for i in held.items if i[2].packet_id not in early])
    assert set(await drain._pay(first)) == {"credited"}
    await drain._finish(first, ["credited"] * len(first.items))
    now = max(p.expires_ms for p in sent) + 1
    for p in sent:
        r = await settlement.refund_packet(core, p.packet_id, now=now)
        paid_out = sum(m for (pid, _), m in told.items() if pid == p.packet_id)
        assert (r.outcome, r.amount) == ("refunded", 3_000 - paid_out)
    assert set(await drain._pay(second)) == {"already"}  # the refunds paid them first
    rows = await core.db.fetchall(
        "SELECT packet_id, user_id, amount FROM grab_records WHERE status = 'credited'"
    )
    assert {(int(p), int(u)): int(m) for p, u, m in rows} == told
    assert (await reconcile(core)).ok
    await assert_books_balance(core)


async def test_a_refund_whose_packet_vanishes_from_redis_after_its_repair_rebuilds_it_again(
    core: Core, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The packet's keys go (expired, evicted, lost) between the refund's repair and its close: the close
    finds no packet there, not "no grabs". The refund rebuilds it again, with the credit still in the
    outbox, and pays that grab before it gives anything back."""
    w = await make_world(core, members=3, admin_cents=10_000)
    p = await packets.send_packet(core, sender_id=w.admin, group_id=w.group, kind="lucky", total=900, count=3)
    told = (await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=w.members[0])).grab
    real_recover = settlement.recover_packet
    vanished: list[int] = []

    async def recover_then_vanish(c: Core, packet_id: int) -> packets.Recovered:
        done = await real_recover(c, packet_id)
        if not vanished:
            vanished.append(await c.redis.delete(*keys.packet_keys(group_id=w.group, packet_id=packet_id)))
        return done

    monkeypatch.setattr(settlement, "recover_packet", recover_then_vanish)
    r = await settlement.refund_packet(core, p.packet_id, now=p.expires_ms + 1)
    assert vanished and vanished[0] > 0
    assert (r.outcome, r.amount) == ("refunded", 900 - told.amount)
    assert await ledger.balance(core.db, told.user_id) == told.amount
    assert await run_worker(core) == 1  # the credit in the outbox: found paid
    assert (await reconcile(core)).ok
