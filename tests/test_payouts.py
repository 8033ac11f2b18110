"""Money out (``server.money.payouts``) on both databases: a withdrawal debits once per request id and
never below zero; a hold takes the money off the balance, then is confirmed, released or expires, each
step once; every step has its event; reconciliation balances money in against balances, packets and
money out, and catches a hold or an event that went wrong."""

from __future__ import annotations

import asyncio

import pytest

from server import errors
from server.core import Core
from server.errors import RedPacketError
from server.ids import UserId
from server.money import events, ledger, payouts
from server.money.reconcile import reconcile
from server.store.db import Tx, as_text
from tests.conftest import make_world
from tests.dbproxy import MySQLProxy
from worker.settle import expire_holds_job


async def _rich(core: Core, cents: int = 10_000) -> UserId:
    user = await ledger.create_user(core.db, "payee")
    await ledger.topup(core.db, user, cents, "in")
    return user


async def _journal(core: Core, key: str) -> list[tuple[int, int]]:
    rows = await core.db.fetchall("SELECT account_id, amount FROM journal WHERE idem_key = %s", (key,))
    return [(int(a), int(m)) for a, m in rows]


async def _types(core: Core) -> list[str]:
    return [e["type"] for e in await events.page(core.db, after=0, limit=500)]


async def test_a_withdrawal_debits_once_per_request_id(core: Core) -> None:
    user = await _rich(core)
    assert await payouts.withdraw(core.db, user, 2_500, "w-1") is True
    assert await payouts.withdraw(core.db, user, 2_500, "w-1") is False  # the retry: nothing more
    assert await ledger.balance(core.db, user) == 7_500
    assert await _journal(core, "withdraw:w-1") == [(user, -2_500)]
    for amount, other in [(2_400, user), (2_500, await ledger.create_user(core.db, "other"))]:
        with pytest.raises(RedPacketError) as e:
            await payouts.withdraw(core.db, other, amount, "w-1")
        assert e.value.code == errors.IDEMPOTENCY_KEY_REUSED
    report = await reconcile(core)
    assert report.ok, report.differences
    assert (report.money_in, report.in_balances, report.paid_out) == (10_000, 7_500, 2_500)
    assert await _types(core) == ["account.topup", "account.withdrawn"]


async def test_bad_withdrawals_move_nothing(core: Core) -> None:
    user = await _rich(core, 1_000)
    for amount, rid, code in [
        (1_001, "w", errors.INSUFFICIENT_FUNDS),
        (0, "w", errors.AMOUNT_INVALID),
        (-5, "w", errors.AMOUNT_INVALID),
        (1.5, "w", errors.AMOUNT_INVALID),
        (True, "w", errors.AMOUNT_INVALID),
        (100, "", errors.BAD_REQUEST),
        (100, " w", errors.BAD_REQUEST),
        (100, 7, errors.BAD_REQUEST),
    ]:
        with pytest.raises(RedPacketError) as e:
            await payouts.withdraw(core.db, user, amount, rid)
        assert e.value.code == code, (amount, rid)
    with pytest.raises(RedPacketError) as e:
        await payouts.withdraw(core.db, UserId(user + 10**9), 100, "nobody")
    assert e.value.code == errors.USER_NOT_FOUND
    assert await ledger.balance(core.db, user) == 1_000
    assert await _types(core) == ["account.topup"]
    assert (await reconcile(core)).ok


@pytest.mark.parametrize("core", ["mysql"], indirect=True)
async def test_concurrent_withdrawals_never_take_the_balance_below_zero(core: Core) -> None:
    """Ten withdrawals of 300 at once from 1,000: three are paid, seven refused, none twice."""
    user = await _rich(core, 1_000)
    answers = await asyncio.gather(
        *(payouts.withdraw(core.db, user, 300, f"race-{i}") for i in range(10)), return_exceptions=True
    )
    paid = [a for a in answers if a is True]
    refused = [a for a in answers if isinstance(a, RedPacketError) and a.code == errors.INSUFFICIENT_FUNDS]
    assert (len(paid), len(refused)) == (3, 7), answers
    assert await ledger.balance(core.db, user) == 100
    assert (await reconcile(core)).ok


@pytest.mark.parametrize("core", ["mysql"], indirect=True)
async def test_concurrent_retries_of_one_withdrawal_pay_it_once(core: Core) -> None:
    user = await _rich(core, 1_000)
    answers = await asyncio.gather(*(payouts.withdraw(core.db, user, 400, "same") for _ in range(12)))
    assert sorted(answers) == [False] * 11 + [True]
    assert await ledger.balance(core.db, user) == 600
    assert await _journal(core, "withdraw:same") == [(user, -400)]


async def test_held_money_cannot_be_spent_and_a_hold_is_settled_once(core: Core) -> None:
    user = await _rich(core, 1_000)
    h = await payouts.hold(core.db, user, 800, "h-1")
    assert (h.state, h.replay, h.expires_ms - h.created_ms) == ("held", False, 3_600_000)
    assert await ledger.balance(core.db, user) == 200
    with pytest.raises(RedPacketError) as e:  # held money is not the balance's
        await payouts.withdraw(core.db, user, 300, "w")
    assert e.value.code == errors.INSUFFICIENT_FUNDS
    assert (await payouts.hold(core.db, user, 800, "h-1")).replay is True
    confirmed = await payouts.settle_hold(core.db, "h-1", "confirmed")
    assert (confirmed.state, confirmed.replay) == ("confirmed", False)
    assert (await payouts.settle_hold(core.db, "h-1", "confirmed")).replay is True
    with pytest.raises(RedPacketError) as e:
        await payouts.settle_hold(core.db, "h-1", "released")
    assert (e.value.code, e.value.details) == (errors.HOLD_CLOSED, {"state": "confirmed"})
    assert await ledger.balance(core.db, user) == 200

    await payouts.hold(core.db, user, 150, "h-2", 60)
    released = await payouts.settle_hold(core.db, "h-2", "released")
    assert released.state == "released" and await ledger.balance(core.db, user) == 200
    assert (await payouts.settle_hold(core.db, "h-2", "released")).replay is True
    with pytest.raises(RedPacketError) as e:
        await payouts.settle_hold(core.db, "h-2", "confirmed")
    assert e.value.code == errors.HOLD_CLOSED
    with pytest.raises(RedPacketError) as e:
        await payouts.settle_hold(core.db, "never", "confirmed")
    assert e.value.code == errors.HOLD_NOT_FOUND
    for bad in [59, 604_801, "60", 1.0]:
        with pytest.raises(RedPacketError) as e:
            await payouts.hold(core.db, user, 10, "h-3", bad)
        assert e.value.code == errors.BAD_REQUEST
    report = await reconcile(core)
    assert report.ok, report.differences
    assert report.paid_out == 800
    assert await _types(core) == [
        "account.topup",
        "hold.created",
        "hold.confirmed",
        "hold.created",
        "hold.released",
    ]


async def _age(core: Core, rid: str, by_ms: int) -> None:
    """Move a hold's expiry ``by_ms`` into the past (time passing, without waiting for it)."""
    await core.db.run(
        lambda tx: tx.execute(
            "UPDATE holds SET expires_ms = expires_ms - %s WHERE request_id = %s", (by_ms, rid)
        ),
        idempotent=True,
    )


async def test_a_hold_expires_on_its_own_and_a_late_confirm_finds_it_expired(core: Core) -> None:
    user = await _rich(core, 1_000)
    await payouts.hold(core.db, user, 300, "job", 60)
    await payouts.hold(core.db, user, 200, "late", 60)
    assert await payouts.expire_due(core.db) == 0  # not yet
    await _age(core, "job", 61_000)
    assert await expire_holds_job({"core": core}) == 1  # the worker's job, every minute
    assert (await payouts.get_hold(core.db, "job")).state == "expired"
    await _age(core, "late", 61_000)
    # The job has not reached "late" yet: a confirm now is refused, and the expiry it found is kept.
    with pytest.raises(RedPacketError) as e:
        await payouts.settle_hold(core.db, "late", "confirmed")
    assert (e.value.code, e.value.details) == (errors.HOLD_CLOSED, {"state": "expired"})
    assert (await payouts.get_hold(core.db, "late")).state == "expired"
    assert await ledger.balance(core.db, user) == 1_000
    assert await payouts.expire_due(core.db) == 0
    assert await _types(core) == [
        "account.topup",
        "hold.created",
        "hold.created",
        "hold.expired",
        "hold.expired",
    ]
    assert (await reconcile(core)).ok


@pytest.mark.parametrize("core", ["mysql"], indirect=True)
async def test_a_repeated_hold_past_its_expiry_answers_it_expired(core: Core) -> None:
    user = await _rich(core, 1_000)
    await payouts.hold(core.db, user, 300, "again", 60)
    await _age(core, "again", 61_000)
    repeat = await payouts.hold(core.db, user, 300, "again", 600)  # (another expires_in_s: the first stands)
    assert (repeat.state, repeat.replay, repeat.expires_ms - repeat.created_ms) == ("expired", True, -1_000)
    assert await ledger.balance(core.db, user) == 1_000
    assert (await reconcile(core)).ok


@pytest.mark.parametrize("core", ["mysql"], indirect=True)
async def test_a_hold_left_held_past_its_expiry_is_reported(core: Core) -> None:
    user = await _rich(core, 1_000)
    await payouts.hold(core.db, user, 300, "forgotten", 60)
    await _age(core, "forgotten", 60_000 + 16 * 60_000)
    assert "hold_stuck" in (await reconcile(core)).checks()
    await payouts.expire_due(core.db)
    assert (await reconcile(core)).ok


@pytest.mark.parametrize("core", ["mysql"], indirect=True)
@pytest.mark.parametrize("step", ["withdraw", "hold", "confirm", "release"])
async def test_a_step_whose_commit_answer_is_lost_moves_money_once(
    lossy: tuple[Core, MySQLProxy], step: str
) -> None:
    """The database commits and the answer never comes back: ``Database.run`` runs the step again, which
    finds its own rows; the money moved once and the event was written once."""
    c, proxy = lossy
    user = await _rich(c, 1_000)
    if step in ("confirm", "release"):
        await payouts.hold(c.db, user, 400, "h")
    proxy.lose_commit_answers(1)
    if step == "withdraw":
        replay = not await payouts.withdraw(c.db, user, 400, "w")
    elif step == "hold":
        replay = (await payouts.hold(c.db, user, 400, "h")).replay
    else:
        replay = (
            await payouts.settle_hold(c.db, "h", "confirmed" if step == "confirm" else "released")
        ).replay
    assert proxy.lost == 1  # the dangerous state existed
    assert replay is False  # done by this call: its own run again is no replay
    assert await ledger.balance(c.db, user) == (1_000 if step == "release" else 600)
    report = await reconcile(c)
    assert report.ok, report.differences
    n = await c.db.fetchone("SELECT COUNT(*) FROM events")
    assert n is not None and int(n[0]) == {"withdraw": 2, "hold": 2, "confirm": 3, "release": 3}[step]


async def test_reconciliation_catches_money_out_gone_wrong(core: Core) -> None:
    """Each way a hold, a withdrawal or an event can go wrong in the database is reported by name."""
    user = await _rich(core, 5_000)
    await payouts.withdraw(core.db, user, 100, "w")
    await payouts.hold(core.db, user, 200, "h-released")
    await payouts.settle_hold(core.db, "h-released", "released")
    await payouts.hold(core.db, user, 300, "h-held")
    assert (await reconcile(core)).ok

    async def tamper(sql: str, *params: object) -> set[str]:
        await core.db.run(lambda tx: tx.execute(sql, params), idempotent=False)
        return (await reconcile(core)).checks()

    # A hold marked released whose money never came back.
    assert "hold_release" in await tamper("UPDATE holds SET state = 'released' WHERE request_id = 'h-held'")
    await tamper("UPDATE holds SET state = 'held' WHERE request_id = 'h-held'")
    # A withdrawal's event lost; an event with no journal row behind it.
    checks = await tamper("DELETE FROM events WHERE idem_key = 'withdraw:w'")
    assert "event_missing" in checks
    checks = await tamper(
        "INSERT INTO events (type, idem_key, user_id, amount, body, created_ms, shard_id)"
        " VALUES ('account.withdrawn', 'withdraw:ghost', %s, -50, '{}', 0, %s)",
        user,
        user,
    )
    assert "event_unbacked" in checks
    # Money that left the balance with no journal row: the account and the global sum disagree.
    checks = await tamper("UPDATE accounts SET balance = balance - 7 WHERE user_id = %s", user)
    assert {"account_journal", "global"} <= checks
    # A hold's journal row with no hold.
    checks = await tamper("DELETE FROM holds WHERE request_id = 'h-released'")
    assert "hold_posting" in checks
    # A second withdrawal posted by one call (a run again that made its key inside the transaction).
    checks = await tamper(
        "INSERT INTO journal (account_id, amount, kind, idem_key, packet_id, created_ms, tx)"
        " SELECT account_id, amount, kind, 'withdraw:made-inside', packet_id, created_ms, tx FROM journal"
        " WHERE idem_key = 'withdraw:w'"
    )
    assert "repeated_posting" in checks


@pytest.mark.parametrize("core", ["mysql"], indirect=True)
async def test_an_event_that_commits_late_is_never_skipped_by_a_reader(core: Core) -> None:
    """Transaction A writes its event first (the lower id) and commits last. A reader paging by event id
    has passed B's event meanwhile: A's must still come after, because ids are given after commit. (Paged
    by the insert id, the reader would have skipped it: the guard this test keeps.)"""
    user = await _rich(core, 1_000)
    seen = [e["id"] for e in await events.page(core.db, after=0, limit=100)]
    started, finish = asyncio.Event(), asyncio.Event()

    async def slow(tx: Tx) -> None:
        await events.record(tx, "account.withdrawn", "late", user, None, {"n": "A"}, 1)
        started.set()
        await finish.wait()

    a = asyncio.create_task(core.db.run(slow, idempotent=False))
    await asyncio.wait_for(started.wait(), 30)
    await core.db.run(
        lambda tx: events.record(tx, "account.withdrawn", "early", user, None, {"n": "B"}, 2),
        idempotent=False,
    )
    page = await events.page(core.db, after=seen[-1], limit=100)
    assert [e["data"]["n"] for e in page] == ["B"]
    finish.set()
    await a
    ids = await core.db.fetchall(
        "SELECT id, idem_key FROM events WHERE idem_key IN ('late', 'early') ORDER BY id"
    )
    assert [as_text(k) for _, k in ids] == [
        "late",
        "early",
    ]  # A has the lower insert id: the state that was dangerous
    later = await events.page(core.db, after=page[-1]["id"], limit=100)
    assert [e["data"]["n"] for e in later] == ["A"] and later[0]["id"] > page[-1]["id"]


async def test_every_money_change_has_its_event_in_order(core: Core) -> None:
    """A packet's life: sent, each share credited, finished; the events page in seq order, and the ids
    a reader is given only grow."""
    from server.money import packets
    from server.money.crediting import credit_many
    from server.store.records import CreditEntry

    w = await make_world(core, members=2, admin_cents=1_000)
    p = await packets.send_packet(core, sender_id=w.admin, group_id=w.group, kind="equal", total=400, count=2)
    credits = [CreditEntry(p.packet_id, m, i + 1, 200, 1) for i, m in enumerate(w.members)]
    assert await credit_many(core.db, credits) == ["credited", "credited"]
    page = await events.page(core.db, after=0, limit=500)
    assert [e["type"] for e in page] == [
        "account.topup",
        "packet.sent",
        "share.credited",
        "share.credited",
        "packet.finished",
    ]
    assert page[1]["data"] == {
        "packet_id": p.packet_id,
        "group_id": w.group,
        "sender_id": w.admin,
        "kind": "equal",
        "total": 400,
        "count": 2,
        "target": None,
        "expires_ms": p.expires_ms,
    }
    assert {e["user_id"] for e in page[2:4]} == set(w.members)
    assert page[4]["data"]["packet_id"] == p.packet_id and page[4]["user_id"] == w.admin
    assert (await reconcile(core)).ok


async def test_reconciliation_catches_events_that_say_what_the_ledger_does_not(core: Core) -> None:
    """An event that moves no money must still be true, and each event is of its journal row's kind;
    a hold's debit, a confirmation and a packet's end missing are each reported."""
    from server.money import packets
    from server.money.crediting import credit_many
    from server.store.records import CreditEntry

    w = await make_world(core, members=1, admin_cents=1_000)
    p = await packets.send_packet(core, sender_id=w.admin, group_id=w.group, kind="equal", total=100, count=1)
    await credit_many(core.db, [CreditEntry(p.packet_id, w.members[0], 1, 100, 1)])
    await payouts.hold(core.db, w.admin, 50, "confirmed")
    await payouts.settle_hold(core.db, "confirmed", "confirmed")
    await payouts.hold(core.db, w.admin, 60, "released")
    await payouts.settle_hold(core.db, "released", "released")
    assert (await reconcile(core)).ok

    async def checks_after(sql: str, *params: object) -> set[str]:
        await core.db.run(lambda tx: tx.execute(sql, params), idempotent=False)
        return (await reconcile(core)).checks()

    forged = (
        "INSERT INTO events (type, idem_key, user_id, amount, body, created_ms, shard_id)"
        " VALUES (%s, %s, %s, %s, '{}', 0, %s)"
    )
    # A confirmation of a hold that was released: the backend would think the money left.
    assert "event_untrue" in await checks_after(
        forged, "hold.confirmed", "confirm:released", w.admin, None, w.admin
    )
    await checks_after("DELETE FROM events WHERE idem_key = 'confirm:released'")
    # The end of a packet that is not finished.
    assert "event_untrue" in await checks_after(
        forged, "packet.finished", "finished:999999", w.admin, None, w.admin
    )
    await checks_after("DELETE FROM events WHERE idem_key = 'finished:999999'")
    # A withdrawal's journal row reported as a top-up.
    assert "event_untrue" in await checks_after(
        "UPDATE events SET type = 'account.topup' WHERE idem_key = 'hold:released'"
    )
    await checks_after("UPDATE events SET type = 'hold.created' WHERE idem_key = 'hold:released'")
    assert (await reconcile(core)).ok
    # Missing: the confirmation, the packet's end, a hold's debit.
    assert "event_missing" in await checks_after("DELETE FROM events WHERE idem_key = 'confirm:confirmed'")
    await checks_after("DELETE FROM events WHERE idem_key = %s", f"finished:{p.packet_id}")
    said = [d.subject for d in (await reconcile(core)).differences]
    # (Named: on a sharded ledger too, where a send's journal key is not send:<packet>.)
    assert f"packet {p.packet_id} finished with no event" in said, said
    assert "hold_debit" in await checks_after("DELETE FROM journal WHERE idem_key = 'hold:confirmed'")
