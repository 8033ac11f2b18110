"""send → grab → credit → balance, through the workers' credit drain, exactly once."""

from __future__ import annotations

import asyncio

import pytest

from server import errors
from server.core import Core
from server.errors import Conflict
from server.money import grabs, ledger, packets
from server.money.ledger import Credit
from server.store import keys
from tests.conftest import make_world, outbox
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


async def test_full_packet_is_credited_exactly(core: Core) -> None:
    w = await make_world(core, members=12, admin_cents=50_000)
    p = await packets.send_packet(core, w.admin, w.group, "lucky", 12_345, 10)
    results = await asyncio.gather(
        *(grabs.grab(core, p.packet_id, w.group, u) for u in w.members), return_exceptions=True
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
    """lua/grab.lua writes the credit record keys.credit_entry names to the shard's outbox."""
    w = await make_world(core, members=1, admin_cents=10_000)
    p = await packets.send_packet(core, w.admin, w.group, "lucky", 777, 1)
    g = (await grabs.grab(core, p.packet_id, w.group, w.members[0])).grab
    mine = (p.packet_id, g.user_id, g.seq, g.amount, g.grabbed_ms, w.group)
    assert await outbox(core, w.group) == [mine]
    # Ids and amounts past 32 bits, on a packet that lives only in Redis.
    big, user = 2**40 + 3, 2**33 + 5
    meta, shares, _, _ = keys.packet_keys(w.group, big)
    await core.redis.hset(meta, mapping={"group": w.group, "expires_ms": ledger.now_ms() + 60_000})
    await core.redis.rpush(shares, f"70000:{2**31 + 7}")
    k, args = grabs.grab_call(core, big, w.group, user, False, False)
    res = await core.scripts.grab(keys=k, args=args)
    assert res[0] == b"won"
    g2 = grabs.parse_record(user, res[1])
    assert await outbox(core, w.group) == [mine, (big, user, 70_000, 2**31 + 7, g2.grabbed_ms, w.group)]
    await core.redis.delete(*keys.packet_keys(w.group, big))


async def test_a_repeat_grab_answers_the_same_share_and_records_no_second_credit(core: Core) -> None:
    w = await make_world(core, members=1, admin_cents=10_000)
    p = await packets.send_packet(core, w.admin, w.group, "lucky", 600, 1)
    g = (await grabs.grab(core, p.packet_id, w.group, w.members[0])).grab
    again = await grabs.grab(core, p.packet_id, w.group, w.members[0])
    assert again.outcome == "already" and again.grab == g
    assert len(await outbox(core, w.group)) == 1
    assert await run_worker(core) == 1
    assert (await grabs.grab(core, p.packet_id, w.group, w.members[0])).outcome == "already"
    assert await outbox(core, w.group) == []  # paid: off the outbox
    assert await ledger.balance(core.db, w.members[0]) == 600


async def test_a_credit_run_twice_pays_once(core: Core) -> None:
    w = await make_world(core, members=1, admin_cents=10_000)
    p = await packets.send_packet(core, w.admin, w.group, "lucky", 500, 1)
    g = (await grabs.grab(core, p.packet_id, w.group, w.members[0])).grab
    c = Credit(p.packet_id, g.user_id, g.seq, g.amount, g.grabbed_ms, w.group)
    assert await ledger.credit_grab(core.db, c) == "credited"
    assert await ledger.credit_grab(core.db, c) == "already"
    assert await run_worker(core) == 1  # the recorded credit is handled too, and pays nothing more
    assert await ledger.balance(core.db, w.members[0]) == 500
    row = await core.db.fetchone("SELECT COUNT(*) FROM journal WHERE kind = 'grab'")
    assert row is not None and int(row[0]) == 1
    await assert_books_balance(core)


async def test_concurrent_duplicate_credits_pay_once(core: Core) -> None:
    w = await make_world(core, members=1, admin_cents=10_000)
    p = await packets.send_packet(core, w.admin, w.group, "equal", 700, 1)
    g = (await grabs.grab(core, p.packet_id, w.group, w.members[0])).grab
    c = Credit(p.packet_id, g.user_id, g.seq, g.amount, g.grabbed_ms)
    outcomes = await asyncio.gather(*(ledger.credit_grab(core.db, c) for _ in range(8)))
    assert sorted(outcomes) == ["already"] * 7 + ["credited"]
    assert await ledger.balance(core.db, w.members[0]) == 700


@pytest.mark.parametrize("lie", ["amount", "seq_of_other", "user_of_other"])
async def test_the_database_refuses_what_redis_cannot_prove(core: Core, lie: str) -> None:
    w = await make_world(core, members=2, admin_cents=10_000)
    p = await packets.send_packet(core, w.admin, w.group, "lucky", 1_000, 2)
    a = (await grabs.grab(core, p.packet_id, w.group, w.members[0])).grab
    b = (await grabs.grab(core, p.packet_id, w.group, w.members[1])).grab
    await ledger.credit_grab(core.db, Credit(p.packet_id, a.user_id, a.seq, a.amount, a.grabbed_ms))
    bad = {
        "amount": Credit(p.packet_id, b.user_id, b.seq, b.amount + 1, b.grabbed_ms),
        "seq_of_other": Credit(p.packet_id, b.user_id, a.seq, a.amount, b.grabbed_ms),
        "user_of_other": Credit(p.packet_id, a.user_id, b.seq, b.amount, b.grabbed_ms),
    }[lie]
    with pytest.raises(Conflict) as e:
        await ledger.credit_grab(core.db, bad)
    assert e.value.code == errors.SHARE_CONFLICT
    assert await ledger.balance(core.db, w.members[1]) == 0
    assert await ledger.balance(core.db, w.members[0]) == a.amount
    await assert_books_balance(core)


async def test_no_credit_lands_on_a_refunded_packet(core: Core) -> None:
    w = await make_world(core, members=1, admin_cents=10_000)
    p = await packets.send_packet(core, w.admin, w.group, "lucky", 300, 1)
    g = (await grabs.grab(core, p.packet_id, w.group, w.members[0])).grab
    await core.db.run(
        lambda tx: tx.execute("UPDATE red_packets SET status = 'refunded' WHERE id = %s", (p.packet_id,)),
        idempotent=True,
    )
    with pytest.raises(Conflict) as e:
        await ledger.credit_grab(core.db, Credit(p.packet_id, g.user_id, g.seq, g.amount, g.grabbed_ms))
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
        p = await packets.send_packet(core, w.admin, w.group, "lucky", 900, 3)
        gs = [(await grabs.grab(core, p.packet_id, w.group, u)).grab for u in w.members]
        credits = [Credit(p.packet_id, g.user_id, g.seq, g.amount, g.grabbed_ms) for g in gs]
        assert await credit_many(core.db, credits[:2]) == ["credited", "credited"]
        assert await _status(core, p.packet_id) == ("active", None)
        if last_alone:
            assert await ledger.credit_grab(core.db, credits[2]) == "credited"
        else:
            assert await credit_many(core.db, credits) == ["already", "already", "credited"]
        # "finished" means every share paid, from the commit that paid the last one; finished_ms is when
        # the last share was grabbed (what "all grabbed in 1.3 s" is computed from).
        assert await _status(core, p.packet_id) == ("finished", max(g.grabbed_ms for g in gs))
    await assert_books_balance(core)
