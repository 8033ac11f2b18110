"""A COMMIT whose answer is lost: MariaDB commits, the client's connection dies before it hears so
(``tests/dbproxy.py``). ``Database.run`` runs keyed work again and finds its own first run's rows; work
that is not keyed is not run again. Every case here makes the loss happen and asserts it did."""

from __future__ import annotations

import logging

import pytest

from server.core import Core, transient
from server.money import crediting, grabs, groups, ledger, packets, settlement
from server.money.crediting import credit_many
from server.money.reconcile import reconcile
from server.store import keys
from server.store.db import DatabaseError, OutcomeUnknown, RetryableError, Unreachable
from server.store.engines import connect
from server.store.records import CreditEntry
from tests.books import assert_books_balance
from tests.conftest import make_world
from tests.dbproxy import MySQLProxy

pytestmark = pytest.mark.parametrize("core", ["mysql"], indirect=True)


async def _count(core: Core, sql: str, *params: object) -> int:
    row = await core.db.fetchone(sql, params)
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize("guard", ["on", "off"])
async def test_a_send_without_request_id_whose_commit_answer_is_lost_debits_once(
    lossy: tuple[Core, MySQLProxy], guard: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The send is keyed before its transaction (a key made by the server when the client gave none), so
    the run again finds the first run's packet. With the key made inside instead (the hole, ``off``),
    the run again makes a second packet and a second debit — and reconciliation says so."""
    c, proxy = lossy
    if guard == "off":
        monkeypatch.setattr(packets, "new_request_id", lambda: None)
    w = await make_world(c, members=3, admin_cents=10_000)
    proxy.lose_commit_answers(1)
    p = await packets.send_packet(c, sender_id=w.admin, group_id=w.group, kind="lucky", total=500, count=2)
    assert proxy.lost == 1  # the dangerous state existed: committed, and the client did not hear it
    sent = await _count(c, "SELECT COUNT(*) FROM red_packets WHERE sender_id = %s", w.admin)
    report = await reconcile(c)
    if guard == "off":
        assert sent == 2 and await ledger.balance(c.db, w.admin) == 9_000
        assert "repeated_posting" in report.checks(), report.differences
        return
    assert sent == 1 and not p.replay
    assert await ledger.balance(c.db, w.admin) == 9_500
    # The first run's packet was put up in Redis and announced as any new packet: it can be grabbed.
    got = await grabs.grab(c, packet_id=p.packet_id, group_id=w.group, user_id=w.members[0])
    assert got.outcome == "won"
    assert report.ok, report.differences


async def test_a_client_retry_of_that_send_is_still_a_replay(lossy: tuple[Core, MySQLProxy]) -> None:
    c, proxy = lossy
    w = await make_world(c, members=3, admin_cents=10_000)
    proxy.lose_commit_answers(1)
    first = await packets.send_packet(
        c, sender_id=w.admin, group_id=w.group, kind="lucky", total=500, count=2, request_id="tap-1"
    )
    assert proxy.lost == 1 and not first.replay  # this call's own packet, though its answer was lost
    again = await packets.send_packet(
        c, sender_id=w.admin, group_id=w.group, kind="lucky", total=500, count=2, request_id="tap-1"
    )
    assert again.replay and again.packet_id == first.packet_id
    assert await ledger.balance(c.db, w.admin) == 9_500


async def test_a_top_up_whose_commit_answer_is_lost_is_paid_once_and_not_called_a_replay(
    lossy: tuple[Core, MySQLProxy],
) -> None:
    c, proxy = lossy
    user = await ledger.create_user(c.db, "li")
    proxy.lose_commit_answers(1)
    assert await ledger.topup(c.db, user, 700, "t1") is True  # paid by this call: not a replay
    assert proxy.lost == 1
    assert await ledger.topup(c.db, user, 700, "t1") is False  # the client's own retry is one
    assert await ledger.balance(c.db, user) == 700
    assert (await reconcile(c)).ok


async def test_a_credit_batch_whose_commit_answer_is_lost_pays_once_and_counts_as_credited(
    lossy: tuple[Core, MySQLProxy],
) -> None:
    c, proxy = lossy
    w = await make_world(c, members=5, admin_cents=10_000)
    p = await packets.send_packet(c, sender_id=w.admin, group_id=w.group, kind="lucky", total=1_000, count=5)
    credits = []
    for u in w.members:
        g = (await grabs.grab(c, packet_id=p.packet_id, group_id=w.group, user_id=u)).grab
        credits.append(CreditEntry(p.packet_id, u, g.seq, g.amount, g.grabbed_ms, w.group))
    await credit_many(c.db, credits[:1])  # another worker's credit: "already" stays "already"
    proxy.lose_commit_answers(1)
    outcomes = await credit_many(c.db, credits)
    assert proxy.lost == 1
    assert outcomes == ["already"] + ["credited"] * 4
    assert await _count(c, "SELECT COUNT(*) FROM journal WHERE kind = 'grab'") == 5
    for credit in credits:
        assert await ledger.balance(c.db, credit.user_id) == credit.amount
    assert (await reconcile(c)).ok
    await assert_books_balance(c)


async def test_a_refund_whose_commit_answer_is_lost_says_refunded_and_cleans_redis(
    lossy: tuple[Core, MySQLProxy],
) -> None:
    c, proxy = lossy
    w = await make_world(c, members=3, admin_cents=10_000)
    p = await packets.send_packet(c, sender_id=w.admin, group_id=w.group, kind="lucky", total=900, count=3)
    won = (await grabs.grab(c, packet_id=p.packet_id, group_id=w.group, user_id=w.members[0])).grab
    proxy.lose_commit_answers(1, after=f"refund:{p.packet_id}".encode())  # the pay-back's COMMIT
    r = await settlement.refund_packet(c, p.packet_id, now=p.expires_ms + 1)
    assert proxy.lost == 1
    assert r.outcome == "refunded" and r.amount == 900 - won.amount, r
    assert await ledger.balance(c.db, w.admin) == 10_000 - won.amount
    assert await ledger.balance(c.db, w.members[0]) == won.amount
    assert await c.redis.exists(*keys.packet_keys(group_id=w.group, packet_id=p.packet_id)) == 0
    assert (await reconcile(c)).ok


async def test_a_new_group_whose_commit_answer_is_lost_is_not_made_twice(
    lossy: tuple[Core, MySQLProxy],
) -> None:
    """Not keyed, so not run again: the caller hears the outcome is unknown, as an unavailable database."""
    c, proxy = lossy
    owner = await ledger.create_user(c.db, "owner")
    proxy.lose_commit_answers(1)
    with pytest.raises(OutcomeUnknown):
        await groups.create_group(c.db, owner, "family")
    assert proxy.lost == 1
    assert await _count(c, "SELECT COUNT(*) FROM chat_groups WHERE owner_id = %s", owner) == 1


async def test_a_single_credit_whose_commit_answer_is_lost_counts_as_credited(
    lossy: tuple[Core, MySQLProxy],
) -> None:
    c, proxy = lossy
    w = await make_world(c, members=2, admin_cents=10_000)
    p = await packets.send_packet(c, sender_id=w.admin, group_id=w.group, kind="lucky", total=500, count=2)
    g = (await grabs.grab(c, packet_id=p.packet_id, group_id=w.group, user_id=w.members[0])).grab
    credit = CreditEntry(p.packet_id, g.user_id, g.seq, g.amount, g.grabbed_ms, w.group)
    proxy.lose_commit_answers(1)
    assert await crediting.credit_grab(c.db, credit) == "credited"  # this call paid it
    assert proxy.lost == 1
    assert await crediting.credit_grab(c.db, credit) == "already"  # another call finds it paid
    assert await ledger.balance(c.db, g.user_id) == g.amount


async def test_a_role_set_whose_commit_answer_is_lost_is_set_not_refused(
    lossy: tuple[Core, MySQLProxy],
) -> None:
    """Run again, the UPDATE changes no row (MariaDB counts changed rows): the member is there, in that
    role — not ``not_member``. The same for a role set to what it already is."""
    c, proxy = lossy
    w = await make_world(c, members=1, admin_cents=100)
    member = w.members[0]
    proxy.lose_commit_answers(1)
    await groups.set_role(c.db, c.membership, "admin", group_id=w.group, user_id=member)
    assert proxy.lost == 1
    await groups.set_role(c.db, c.membership, "admin", group_id=w.group, user_id=member)
    row = await c.db.fetchone(
        "SELECT role FROM group_members WHERE group_id = %s AND user_id = %s", (w.group, member)
    )
    assert row is not None and row[0] == "admin"


async def test_a_database_that_refuses_connections_is_a_service_away_not_a_bug(
    core: Core, lossy: tuple[Core, MySQLProxy], caplog: pytest.LogCaptureFixture
) -> None:
    """A MariaDB gone (its port refusing: 2003) is what a lost connection is — retryable, and a warning
    line in background work — while an answer the server gave (a bad statement) stays a bug."""
    c, proxy = lossy
    db = await connect(proxy.url(c.settings.database_url), 1)
    try:
        assert await db.fetchone("SELECT 1") == (1,)
        proxy.cut_at(b"SELECT 41")  # the pooled connection dies
        await proxy.close()  # and the port refuses a new one
        with pytest.raises(RetryableError):
            await db.fetchone("SELECT 41")
        with pytest.raises(Unreachable, match="2003") as refused:
            await db.fetchone("SELECT 1")
        assert transient(refused.value)
        runs = 0

        async def work(tx: object) -> None:
            nonlocal runs
            runs += 1

        with caplog.at_level(logging.WARNING), pytest.raises(Unreachable):
            await db.run(work, idempotent=True)
        assert runs == 0
        assert not [r for r in caplog.records if "retried" in r.getMessage()]  # at once, not five times
    finally:
        await db.close()
    with pytest.raises(DatabaseError) as answer:
        await core.db.fetchone("SELECT no_such_column FROM users")
    assert not isinstance(answer.value, RetryableError) and not transient(answer.value)


async def test_a_send_whose_commit_is_slow_is_its_own_callers_and_put_up_in_redis(
    lossy: tuple[Core, MySQLProxy],
) -> None:
    """The COMMIT of a send reaches the server late, after its client gave up on it: the run again does
    not see the packet yet, its insert waits on the first run's locks and then meets its key. It is still
    this call's own packet (not ``replay``), and this call puts it up in Redis: it can be grabbed at once.
    (Before: answered ``replay: true`` to its own caller and left for a repair to bring up.)"""
    c, proxy = lossy
    w = await make_world(c, members=3, admin_cents=10_000)
    proxy.slow_commit(after=b"INSERT INTO red_packets", until=b"INSERT INTO red_packets")
    p = await packets.send_packet(
        c, sender_id=w.admin, group_id=w.group, kind="lucky", total=500, count=2, request_id="tap-slow"
    )
    assert (proxy.lost, proxy.released) == (1, 1)  # given up on, then committed under the run again
    assert not p.replay and p.published
    assert await ledger.balance(c.db, w.admin) == 9_500
    got = await grabs.grab(c, packet_id=p.packet_id, group_id=w.group, user_id=w.members[0])
    assert got.outcome == "won"
    assert (await reconcile(c)).ok
