"""send → grab → credit → balance, through a real arq worker, exactly once."""

from __future__ import annotations

import asyncio

import pytest
from arq.jobs import serialize_job

from server import errors, keys, ledger, packets
from server.core import Core
from server.errors import Conflict
from server.ledger import Credit
from server.queue import CREDIT_GRAB, job_deserializer, job_serializer
from tests.conftest import make_world
from worker.credit import Ctx, credit_grab_job
from worker.main import make_worker


async def run_worker(core: Core) -> int:
    """Run every queued job, then return how many ran. (No cron jobs: tests call those directly.)"""
    w = make_worker(core, burst=True, poll_delay=0, cron_jobs=[])
    await w.async_run()
    return int(w.jobs_complete)


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
        *(packets.grab(core, p.packet_id, w.group, u) for u in w.members), return_exceptions=True
    )
    won = {r.grab.user_id: r.grab.amount for r in results if isinstance(r, packets.GrabResult)}
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


async def test_the_grab_script_queues_the_job_arq_itself_would(core: Core) -> None:
    """lua/grab.lua builds the credit job's msgpack itself: byte for byte what arq's enqueue makes."""
    w = await make_world(core, members=1, admin_cents=10_000)
    p = await packets.send_packet(core, w.admin, w.group, "lucky", 777, 1)
    g = (await packets.grab(core, p.packet_id, w.group, w.members[0])).grab
    await _assert_arq_job(core, (p.packet_id, g.user_id, g.seq, g.amount, g.grabbed_ms))
    # Ids and amounts past 32 bits, on a packet that lives only in Redis.
    big, user = 2**40 + 3, 2**33 + 5
    meta, shares, _ = keys.packet_keys(big)
    await core.redis.hset(meta, mapping={"group": w.group, "expires_ms": ledger.now_ms() + 60_000})
    await core.redis.rpush(shares, f"70000:{2**31 + 7}")
    k, args = packets.grab_call(core, big, w.group, user, False, False)
    res = await core.scripts.grab(keys=k, args=args)
    assert res[0] == b"won"
    g = packets.parse_record(user, res[1])
    await _assert_arq_job(core, (big, user, 70_000, 2**31 + 7, g.grabbed_ms))
    await core.redis.delete(*keys.packet_keys(big), keys.credit_job_key(big, 70_000))


Args5 = tuple[int, int, int, int, int]


async def _assert_arq_job(core: Core, args: Args5, queued_at_grab: bool = True) -> None:
    job_id = keys.credit_job_id(args[0], args[2])
    blob = await core.redis.get(keys.credit_job_key(args[0], args[2]))
    assert isinstance(blob, bytes)
    et = job_deserializer(blob)["et"]
    assert abs(et - args[4]) <= 1 or not queued_at_grab
    assert blob == serialize_job(CREDIT_GRAB, args, {}, None, et, serializer=job_serializer)
    assert await core.redis.zscore(core.settings.queue_name, job_id) == et


async def test_a_repeat_grab_queues_a_lost_credit_again_and_it_pays_once(core: Core) -> None:
    w = await make_world(core, members=1, admin_cents=10_000)
    p = await packets.send_packet(core, w.admin, w.group, "lucky", 600, 1)
    g = (await packets.grab(core, p.packet_id, w.group, w.members[0])).grab
    await core.redis.delete(keys.credit_job_key(p.packet_id, g.seq), core.settings.queue_name)
    again = await packets.grab(core, p.packet_id, w.group, w.members[0])
    assert again.outcome == "already" and again.grab == g
    await _assert_arq_job(core, (p.packet_id, g.user_id, g.seq, g.amount, g.grabbed_ms), queued_at_grab=False)
    assert await run_worker(core) == 1
    # Once paid, its kept result makes a further repeat queue nothing.
    assert (await packets.grab(core, p.packet_id, w.group, w.members[0])).outcome == "already"
    assert await core.redis.zcard(core.settings.queue_name) == 0
    assert await ledger.balance(core.db, w.members[0]) == 600


async def test_a_credit_run_twice_pays_once(core: Core) -> None:
    w = await make_world(core, members=1, admin_cents=10_000)
    p = await packets.send_packet(core, w.admin, w.group, "lucky", 500, 1)
    g = (await packets.grab(core, p.packet_id, w.group, w.members[0])).grab
    # The grab enqueued its job; enqueueing the same grab again is refused by the job id.
    again = await core.redis.enqueue_job(
        CREDIT_GRAB,
        p.packet_id,
        g.user_id,
        g.seq,
        g.amount,
        g.grabbed_ms,
        _job_id=keys.credit_job_id(p.packet_id, g.seq),
    )
    assert again is None
    ctx: Ctx = {"core": core}
    args = (p.packet_id, g.user_id, g.seq, g.amount, g.grabbed_ms)
    assert await credit_grab_job(ctx, *args) == "credited"
    assert await credit_grab_job(ctx, *args) == "already"
    assert await run_worker(core) == 1  # the queued job runs too, and pays nothing more
    assert await ledger.balance(core.db, w.members[0]) == 500
    row = await core.db.fetchone("SELECT COUNT(*) FROM journal WHERE kind = 'grab'")
    assert row is not None and int(row[0]) == 1
    await assert_books_balance(core)


async def test_concurrent_duplicate_credits_pay_once(core: Core) -> None:
    w = await make_world(core, members=1, admin_cents=10_000)
    p = await packets.send_packet(core, w.admin, w.group, "equal", 700, 1)
    g = (await packets.grab(core, p.packet_id, w.group, w.members[0])).grab
    c = Credit(p.packet_id, g.user_id, g.seq, g.amount, g.grabbed_ms)
    outcomes = await asyncio.gather(*(ledger.credit_grab(core.db, c) for _ in range(8)))
    assert sorted(outcomes) == ["already"] * 7 + ["credited"]
    assert await ledger.balance(core.db, w.members[0]) == 700


@pytest.mark.parametrize("lie", ["amount", "seq_of_other", "user_of_other"])
async def test_the_database_refuses_what_redis_cannot_prove(core: Core, lie: str) -> None:
    w = await make_world(core, members=2, admin_cents=10_000)
    p = await packets.send_packet(core, w.admin, w.group, "lucky", 1_000, 2)
    a = (await packets.grab(core, p.packet_id, w.group, w.members[0])).grab
    b = (await packets.grab(core, p.packet_id, w.group, w.members[1])).grab
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
    g = (await packets.grab(core, p.packet_id, w.group, w.members[0])).grab
    await core.db.run(
        lambda tx: tx.execute("UPDATE red_packets SET status = 'refunded' WHERE id = %s", (p.packet_id,))
    )
    with pytest.raises(Conflict) as e:
        await ledger.credit_grab(core.db, Credit(p.packet_id, g.user_id, g.seq, g.amount, g.grabbed_ms))
    assert e.value.code == errors.PACKET_EXPIRED
    assert await ledger.balance(core.db, w.members[0]) == 0
