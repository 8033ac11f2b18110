"""send → grab → credit → balance, through the workers' credit drain, exactly once."""

from __future__ import annotations

import asyncio

import pytest

from server import errors
from server.core import Core
from server.errors import Conflict
from server.ids import UserId
from server.money import crediting, grabs, ledger, packets, queries
from server.money.reconcile import reconcile
from server.store import keys
from server.store.records import CreditEntry, GrabRecord
from server.store.scriptcalls import run_alone
from tests.books import assert_books_balance, run_worker, set_paid_count
from tests.conftest import make_world, outbox


async def test_full_packet_is_credited_exactly(core: Core) -> None:
    w = await make_world(core, members=12, admin_cents=50_000)
    p = await packets.send_packet(
        core, sender_id=w.admin, group_id=w.group, kind="lucky", total=12_345, count=10
    )
    results = await asyncio.gather(
        *(grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=u) for u in w.members),
        return_exceptions=True,
    )
    won = {r.grab.user_id: r.grab.amount for r in results if isinstance(r, grabs.GrabResult)}
    assert len(won) == 10
    assert await run_worker(core) == 10
    for u in w.members:
        assert await ledger.balance(core.db, u) == won.get(u, 0)
    credited = await core.db.fetchone(
        "SELECT COALESCE(SUM(amount), 0), COUNT(*) FROM journal WHERE kind = 'grab' AND packet_id = %s",
        (p.packet_id,),
    )
    debited = await core.db.fetchone(
        "SELECT -amount FROM journal WHERE kind = 'send' AND packet_id = %s", (p.packet_id,)
    )
    assert credited is not None and debited is not None
    assert int(credited[0]) == int(debited[0]) == 12_345 and int(credited[1]) == 10
    rows = await core.db.fetchall("SELECT status FROM grab_records WHERE packet_id = %s", (p.packet_id,))
    assert [r[0] for r in rows] == ["credited"] * 10
    await assert_books_balance(core)


async def test_the_grab_records_its_credit_in_the_same_call(core: Core) -> None:
    """lua/grab.lua writes the credit record ``records.CreditEntry`` defines to the shard's outbox, byte
    for byte what ``CreditEntry.encode`` makes of it (the format is written in Python once, and Lua's
    copy of it is held to it here), and its grab record likewise."""
    w = await make_world(core, members=1, admin_cents=10_000)
    p = await packets.send_packet(core, sender_id=w.admin, group_id=w.group, kind="lucky", total=777, count=1)
    g = (await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=w.members[0])).grab
    mine = (p.packet_id, g.user_id, g.seq, g.amount, g.grabbed_ms, w.group)
    assert await outbox(core, w.group) == [mine]
    # Ids and amounts past 32 bits, on a packet that lives only in Redis.
    big, user = 2**40 + 3, 2**33 + 5
    meta, shares, _, _ = keys.packet_keys(group_id=w.group, packet_id=big)
    await core.redis.hset(meta, mapping={"group": w.group, "expires_ms": ledger.now_ms() + 60_000})
    await core.redis.rpush(shares, f"70000:{2**31 + 7}")
    call = grabs.grab_call(
        core, packet_id=big, group_id=w.group, user_id=user, check_members=False, gate=False
    )
    reply = await run_alone(core.scripts, call)
    assert reply.status == "won" and reply.record is not None
    assert reply.record.seq == 70_000 and reply.record.amount == 2**31 + 7
    g2 = reply.record
    assert await outbox(core, w.group) == [mine, (big, user, 70_000, 2**31 + 7, g2.grabbed_ms, w.group)]
    raw = [fields[b"c"] for _, fields in await core.redis.xrange(keys.outbox_for(w.group))]
    assert raw[-1] == CreditEntry(big, user, g2.seq, g2.amount, g2.grabbed_ms, w.group).encode().encode()
    held = await core.redis.hget(keys.packet_grabs(group_id=w.group, packet_id=big), str(user))
    assert held == g2.encode().encode() and GrabRecord.parse(held) == g2
    await core.redis.delete(*keys.packet_keys(group_id=w.group, packet_id=big))


async def test_a_repeat_grab_answers_the_same_share_and_records_no_second_credit(core: Core) -> None:
    w = await make_world(core, members=1, admin_cents=10_000)
    p = await packets.send_packet(core, sender_id=w.admin, group_id=w.group, kind="lucky", total=600, count=1)
    g = (await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=w.members[0])).grab
    again = await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=w.members[0])
    assert again.outcome == "already" and again.grab == g
    assert len(await outbox(core, w.group)) == 1
    assert await run_worker(core) == 1
    assert (
        await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=w.members[0])
    ).outcome == "already"
    assert await outbox(core, w.group) == []  # paid: off the outbox
    assert await ledger.balance(core.db, w.members[0]) == 600


async def test_a_credit_run_twice_pays_once(core: Core) -> None:
    w = await make_world(core, members=1, admin_cents=10_000)
    p = await packets.send_packet(core, sender_id=w.admin, group_id=w.group, kind="lucky", total=500, count=1)
    g = (await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=w.members[0])).grab
    c = CreditEntry(p.packet_id, g.user_id, g.seq, g.amount, g.grabbed_ms, w.group)
    assert await crediting.credit_grab(core.db, c) == "credited"
    assert await crediting.credit_grab(core.db, c) == "already"
    assert await run_worker(core) == 1  # the recorded credit is handled too, and pays nothing more
    assert await ledger.balance(core.db, w.members[0]) == 500
    row = await core.db.fetchone("SELECT COUNT(*) FROM journal WHERE kind = 'grab'")
    assert row is not None and int(row[0]) == 1
    await assert_books_balance(core)


async def test_concurrent_duplicate_credits_pay_once(core: Core) -> None:
    w = await make_world(core, members=1, admin_cents=10_000)
    p = await packets.send_packet(core, sender_id=w.admin, group_id=w.group, kind="equal", total=700, count=1)
    g = (await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=w.members[0])).grab
    c = CreditEntry(p.packet_id, g.user_id, g.seq, g.amount, g.grabbed_ms)
    outcomes = await asyncio.gather(*(crediting.credit_grab(core.db, c) for _ in range(8)))
    assert sorted(outcomes) == ["already"] * 7 + ["credited"]
    assert await ledger.balance(core.db, w.members[0]) == 700


@pytest.mark.parametrize("lie", ["amount", "seq_of_other", "user_of_other"])
async def test_the_database_refuses_what_redis_cannot_prove(core: Core, lie: str) -> None:
    w = await make_world(core, members=2, admin_cents=10_000)
    p = await packets.send_packet(
        core, sender_id=w.admin, group_id=w.group, kind="lucky", total=1_000, count=2
    )
    a = (await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=w.members[0])).grab
    b = (await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=w.members[1])).grab
    await crediting.credit_grab(core.db, CreditEntry(p.packet_id, a.user_id, a.seq, a.amount, a.grabbed_ms))
    bad = {
        "amount": CreditEntry(p.packet_id, b.user_id, b.seq, b.amount + 1, b.grabbed_ms),
        "seq_of_other": CreditEntry(p.packet_id, b.user_id, a.seq, a.amount, b.grabbed_ms),
        "user_of_other": CreditEntry(p.packet_id, a.user_id, b.seq, b.amount, b.grabbed_ms),
    }[lie]
    with pytest.raises(Conflict) as e:
        await crediting.credit_grab(core.db, bad)
    assert e.value.code == errors.SHARE_CONFLICT
    assert await ledger.balance(core.db, w.members[1]) == 0
    assert await ledger.balance(core.db, w.members[0]) == a.amount
    await assert_books_balance(core)


async def test_no_credit_lands_on_a_refunded_packet(core: Core) -> None:
    w = await make_world(core, members=1, admin_cents=10_000)
    p = await packets.send_packet(core, sender_id=w.admin, group_id=w.group, kind="lucky", total=300, count=1)
    g = (await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=w.members[0])).grab
    await core.db.run(
        lambda tx: tx.execute("UPDATE red_packets SET status = 'refunded' WHERE id = %s", (p.packet_id,)),
        idempotent=True,
    )
    with pytest.raises(Conflict) as e:
        await crediting.credit_grab(
            core.db, CreditEntry(p.packet_id, g.user_id, g.seq, g.amount, g.grabbed_ms)
        )
    assert e.value.code == errors.PACKET_EXPIRED
    assert await ledger.balance(core.db, w.members[0]) == 0


async def _status(core: Core, packet_id: int) -> tuple[str, int | None]:
    row = await core.db.fetchone("SELECT status, finished_ms FROM red_packets WHERE id = %s", (packet_id,))
    assert row is not None
    return str(row[0]), None if row[1] is None else int(row[1])


async def test_a_packet_is_finished_by_the_transaction_that_credits_its_last_share(core: Core) -> None:
    from server.money.crediting import credit_many

    w = await make_world(core, members=3, admin_cents=10_000)
    for last_alone in (True, False):
        p = await packets.send_packet(
            core, sender_id=w.admin, group_id=w.group, kind="lucky", total=900, count=3
        )
        gs = [
            (await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=u)).grab
            for u in w.members
        ]
        credits = [CreditEntry(p.packet_id, g.user_id, g.seq, g.amount, g.grabbed_ms) for g in gs]
        assert await credit_many(core.db, credits[:2]) == ["credited", "credited"]
        assert await _status(core, p.packet_id) == ("active", None)
        if last_alone:
            assert await crediting.credit_grab(core.db, credits[2]) == "credited"
        else:
            assert await credit_many(core.db, credits) == ["already", "already", "credited"]
        # "finished" means every share paid, from the commit that paid the last one; finished_ms is when
        # the last share was grabbed (what "all grabbed in 1.3 s" is computed from).
        assert await _status(core, p.packet_id) == ("finished", max(g.grabbed_ms for g in gs))
    await assert_books_balance(core)


async def test_a_packet_sent_before_its_paid_count_was_kept_finishes_on_its_records(core: Core) -> None:
    """A packet sent before migration 14 has no count of its shares paid (NULL): its grab records are
    counted instead, and its last credit finishes it all the same."""
    w = await make_world(core, members=3, admin_cents=10_000)
    p = await packets.send_packet(core, sender_id=w.admin, group_id=w.group, kind="lucky", total=900, count=3)
    gs = [
        (await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=u)).grab for u in w.members
    ]
    credits = [CreditEntry(p.packet_id, g.user_id, g.seq, g.amount, g.grabbed_ms) for g in gs]
    assert await crediting.credit_many(core.db, credits[:1]) == ["credited"]
    await set_paid_count(core, p.packet_id, None)
    assert await crediting.credit_many(core.db, credits[1:2]) == ["credited"]
    assert await _status(core, p.packet_id) == ("active", None)
    assert await crediting.credit_many(core.db, credits) == ["already", "already", "credited"]
    assert (await _status(core, p.packet_id))[0] == "finished"
    assert (await reconcile(core)).ok


async def test_a_paid_count_gone_wrong_never_finishes_a_packet_with_a_share_unpaid(core: Core) -> None:
    """A packet's row says one share more is paid than its grab records do: its next credit makes the
    count say "all paid", and the packet stays active (a share is not paid yet) and reconciliation reports
    the count; the last share's credit then reaches every grabber and finishes it."""
    w = await make_world(core, members=2, admin_cents=10_000)
    p = await packets.send_packet(core, sender_id=w.admin, group_id=w.group, kind="lucky", total=200, count=2)
    gs = [
        (await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=u)).grab for u in w.members
    ]
    credits = [CreditEntry(p.packet_id, g.user_id, g.seq, g.amount, g.grabbed_ms) for g in gs]
    await set_paid_count(core, p.packet_id, 1)
    assert await crediting.credit_many(core.db, credits[:1]) == ["credited"]
    count = await core.db.fetchone("SELECT credited_count FROM red_packets WHERE id = %s", (p.packet_id,))
    assert count == (2,)  # the dangerous state exists: the count says every share is paid
    assert await _status(core, p.packet_id) == ("active", None)
    report = await reconcile(core)
    assert [(d.check, d.expected, d.actual) for d in report.differences] == [("packet_paid_count", 1, 2)]
    assert await crediting.credit_many(core.db, credits[1:]) == ["credited"]
    for c in credits:
        assert await ledger.balance(core.db, c.user_id) == c.amount
    # Every share paid now, and the count past them: finished all the same, and the count still reported.
    assert (await _status(core, p.packet_id))[0] == "finished"
    report = await reconcile(core)
    assert [(d.check, d.expected, d.actual) for d in report.differences] == [("packet_paid_count", 2, 3)]


async def _look(core: Core, sender: UserId, until: asyncio.Event, seen: list[tuple[str, int]]) -> None:
    """Read the sender's newest packet as ``GET /api/me/packets/sent`` does (``queries.sent_page``: its
    status and ``paid_out`` in one statement), again and again until ``until`` is set (once at least)."""
    while not until.is_set() or not seen:
        newest = (await queries.sent_page(core.db, sender, before=0, limit=1))[0]
        seen.append((str(newest["status"]), int(str(newest["paid_out"]))))


async def test_the_last_shares_paid_at_once_finish_the_packet_in_the_commit_of_the_last(core: Core) -> None:
    """Two payers (one by one, and a batch) credit a packet's last two shares at the same time while a
    reader looks, as ``/api/me/packets/sent`` does: it never sees every share credited
    and the packet still ``active`` (docs/protocol.md: ``finished`` is set by the transaction that credits
    the last share), and the packet ends ``finished``."""
    from server.money.crediting import credit_many

    if core.db.shards:  # (its three steps: docs/protocol.md says the packet is finished by the third)
        pytest.skip("a sharded ledger marks the packet finished in the step after the last payment")
    w = await make_world(core, members=6, admin_cents=50_000)
    for _ in range(4):
        p = await packets.send_packet(
            core, sender_id=w.admin, group_id=w.group, kind="lucky", total=600, count=6
        )
        gs = [
            (await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=u)).grab
            for u in w.members
        ]
        credits = [CreditEntry(p.packet_id, g.user_id, g.seq, g.amount, g.grabbed_ms) for g in gs]
        assert await credit_many(core.db, credits[:4]) == ["credited"] * 4
        paid = asyncio.Event()
        seen: list[tuple[str, int]] = []
        reader = asyncio.create_task(_look(core, w.admin, paid, seen))
        try:
            await asyncio.gather(
                crediting.credit_grab(core.db, credits[4]), credit_many(core.db, credits[5:])
            )
        finally:
            paid.set()
            await asyncio.wait_for(reader, 30)
        assert ("active", 6) not in seen, seen
        assert (await _status(core, p.packet_id))[0] == "finished"
    await assert_books_balance(core)


async def test_a_share_whose_credit_stopped_half_way_keeps_its_packet_unfinished(core: Core) -> None:
    """On a sharded ledger a credit is three steps: its grab record ``crediting`` first, the payment, then
    ``credited``. Every share has a record once the last one is claimed, but a packet is finished only
    when every record is ``credited``: the one whose payment has not run keeps it active."""
    from server.money import shardsteps
    from server.money.crediting import credit_many

    if not core.db.shards:
        pytest.skip("only a sharded ledger credits in steps (one database writes a record credited)")
    w = await make_world(core, members=2, admin_cents=10_000)
    p = await packets.send_packet(core, sender_id=w.admin, group_id=w.group, kind="lucky", total=200, count=2)
    gs = [
        (await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=u)).grab for u in w.members
    ]
    credits = [CreditEntry(p.packet_id, g.user_id, g.seq, g.amount, g.grabbed_ms) for g in gs]
    # The second share's credit stops after its first step: its record is there, crediting.
    await core.db.run(lambda tx: shardsteps._claim(tx, credits[1:], "drain"), idempotent=True)
    assert await credit_many(core.db, credits[:1]) == ["credited"]
    rows = await core.db.fetchall(
        "SELECT status FROM grab_records WHERE packet_id = %s ORDER BY seq", (p.packet_id,)
    )
    assert sorted(str(r[0]) for r in rows) == ["credited", "crediting"]  # the dangerous state exists
    status = "SELECT status FROM red_packets WHERE id = %s"
    assert await core.db.fetchone(status, (p.packet_id,)) == ("active",)
    assert await credit_many(core.db, credits[1:]) == ["credited"]
    assert await core.db.fetchone(status, (p.packet_id,)) == ("finished",)
