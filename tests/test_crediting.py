"""Batched crediting: many grabs per transaction, each paid exactly once, on both dialects."""

from __future__ import annotations

import asyncio

import pytest

from server import errors
from server.core import Core
from server.money import crediting, grabs, ledger, packets
from server.money.crediting import credit_many
from server.money.reconcile import reconcile
from server.store.db import Tx
from server.store.records import CreditEntry
from tests.books import assert_books_balance, side_session
from tests.conftest import make_world
from worker.drain import CreditDrain


async def _grabs(core: Core, members: int, total: int) -> tuple[int, list[CreditEntry], list[int]]:
    w = await make_world(core, members=members, admin_cents=100_000)
    p = await packets.send_packet(
        core, sender_id=w.admin, group_id=w.group, kind="lucky", total=total, count=members
    )
    credits = []
    for u in w.members:
        g = (await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=u)).grab
        credits.append(CreditEntry(p.packet_id, u, g.seq, g.amount, g.grabbed_ms))
    return p.packet_id, credits, w.members


async def test_a_mixed_batch_pays_each_share_once(core: Core) -> None:
    pid, credits, _ = await _grabs(core, 6, 6_000)
    first, second, third, *rest = credits
    await crediting.credit_grab(core.db, first)  # already paid one by one
    batch = [
        first,  # already
        second,
        second,  # the same grab twice in one batch
        CreditEntry(
            pid, third.user_id, third.seq, third.amount + 1, third.grabbed_ms
        ),  # not the pre-split amount
        CreditEntry(pid, third.user_id, second.seq, second.amount, third.grabbed_ms),  # someone else's share
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
    # Both refusals are recorded in the batch's transaction: the audit reports each until it is paid.
    refused = await core.db.fetchall(
        "SELECT user_id, seq, code, refused_by FROM credit_refusals ORDER BY seq"
    )
    assert sorted((int(u), int(s), str(c), str(b)) for u, s, c, b in refused) == sorted(
        [
            (third.user_id, third.seq, errors.SHARE_CONFLICT, "drain"),
            (third.user_id, second.seq, errors.SHARE_CONFLICT, "drain"),
        ]
    )
    assert {d.subject for d in (await reconcile(core)).differences} == {
        f"packet {pid} user {third.user_id} share {third.seq} (share_conflict, by drain)",
        f"packet {pid} user {third.user_id} share {second.seq} (share_conflict, by drain)",
    }
    # The refused one is paid when its true credit comes; the lie about someone else's share stays.
    assert await credit_many(core.db, [third]) == ["credited"]
    report = await reconcile(core)
    assert [(d.check, d.subject) for d in report.differences] == [
        ("credit_refused", f"packet {pid} user {third.user_id} share {second.seq} (share_conflict, by drain)")
    ]
    await assert_books_balance(core)


@pytest.mark.parametrize("core", ["mysql"], indirect=True)
async def test_a_share_list_the_server_cut_short_is_never_taken_for_the_share(core: Core) -> None:
    """The batch's check of its shares reads each packet's as one string, which MariaDB cuts at
    ``group_concat_max_len`` with only a warning: share 1 of 345 cut to ``1:34`` must not pass a credit
    claiming 34 (nor any credit: each is then read and decided on its own)."""
    pid, (c,), _ = await _grabs(core, 1, 345)
    assert (c.seq, c.amount) == (1, 345)
    lie = CreditEntry(pid, c.user_id, c.seq, 34, c.grabbed_ms)
    async with core.db.transaction() as tx:
        assert await crediting._shares_match(tx, [c]) and not await crediting._shares_match(tx, [lie])
        await tx.execute("SET SESSION group_concat_max_len = 4")  # (MariaDB's least)
        try:
            with pytest.warns(Warning, match="cut by GROUP_CONCAT"):  # (the driver says it, no more)
                cut = await tx.fetchone("SELECT GROUP_CONCAT(seq, ':', amount) FROM red_packet_shares"
                                        " WHERE packet_id = %s", (pid,))  # fmt: skip
                assert cut == ("1:34",)  # the dangerous state exists: the string cut where the lie fits
                assert not await crediting._shares_match(tx, [lie])
                assert not await crediting._shares_match(tx, [c])
        finally:
            await tx.execute("SET SESSION group_concat_max_len = DEFAULT")
    assert await credit_many(core.db, [lie]) == [errors.SHARE_CONFLICT]
    assert await credit_many(core.db, [c]) == ["credited"]
    assert await ledger.balance(core.db, c.user_id) == 345


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
    assert metrics.credits.labels("credited")._value.get() == 100  # counted per batch, every credit
    for c in credits:
        assert await ledger.balance(core.db, c.user_id) == c.amount
    assert (await reconcile(core)).ok


@pytest.mark.parametrize("core", ["mysql"], indirect=True)
async def test_a_clash_on_the_unique_keys_inside_a_batch_pays_each_share_once(
    core: Core, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another payer that did not take the packet's lock pays one of the batch's shares after the batch
    checked its shares and before it writes its grab records: the batch's insert meets the unique keys,
    is undone, and each credit is decided from what the database holds. Only the database's keys stand
    in the way here."""
    pid, credits, _ = await _grabs(core, 6, 6_000)
    victim = credits[2]
    injected = _pay_after_read(monkeypatch, core, "FROM red_packet_shares", victim)
    outcomes = await credit_many(core.db, credits)
    monkeypatch.undo()
    assert injected == [1]  # the clash was made to happen
    await _count_its_share(core, victim)
    assert outcomes == ["already" if c is victim else "credited" for c in credits]
    await _each_share_paid_once(core, pid, credits)


@pytest.mark.parametrize("core", ["mysql"], indirect=True)
async def test_a_clash_after_a_batch_read_the_grab_records_pays_each_share_once(
    core: Core, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same clash in a batch decided credit by credit (one of its shares was paid before): the share
    is paid behind the lock after the batch read the grab records and before it writes them; the batch
    rolls back on the unique keys and each credit is paid alone."""
    pid, credits, _ = await _grabs(core, 6, 6_000)
    paid_before, victim = credits[0], credits[2]
    assert await credit_many(core.db, [paid_before]) == ["credited"]
    injected = _pay_after_read(monkeypatch, core, "FROM grab_records WHERE packet_id IN", victim)
    outcomes = await credit_many(core.db, credits)
    monkeypatch.undo()
    assert injected == [1]
    await _count_its_share(core, victim)
    assert outcomes == ["already" if c in (paid_before, victim) else "credited" for c in credits]
    await _each_share_paid_once(core, pid, credits)


@pytest.mark.parametrize(
    "odd_one", ["paid_before", "amount", "refunded", "no_packet", "amount_elsewhere", "elsewhere"]
)
async def test_a_batch_clean_but_for_one_credit_decides_that_one_alone(core: Core, odd_one: str) -> None:
    """A batch with no share or user twice, whose one odd credit only the database can tell: paid
    before, not the pre-split amount (of this packet, or of a second packet in the batch), of a refunded
    packet, of no packet. That one is decided as alone (paid before: ``already``; the others refused and
    recorded), and every other credit is paid once, including those written before the odd one in the
    batch's insert (undone with it, then written again). A true credit of a second packet is paid too."""
    pid, credits, _ = await _grabs(core, 5, 5_000)
    first, odd, *rest = credits
    if odd_one == "paid_before":
        assert await credit_many(core.db, [odd]) == ["credited"]
        expected = "already"
    elif odd_one == "amount":
        odd = CreditEntry(pid, odd.user_id, odd.seq, odd.amount + 1, odd.grabbed_ms)
        expected = errors.SHARE_CONFLICT
    elif odd_one == "no_packet":
        odd = CreditEntry(pid + 1000, odd.user_id, 1, 10, odd.grabbed_ms)
        expected = errors.PACKET_NOT_FOUND
    else:
        other = await _one_share_packet_beside(core, pid)
        share = await _share(core, other.packet_id, 1)
        expected = {
            "refunded": errors.PACKET_EXPIRED,
            "amount_elsewhere": errors.SHARE_CONFLICT,
            "elsewhere": "credited",
        }[odd_one]
        if odd_one == "refunded":
            await core.db.run(
                lambda tx: tx.execute(
                    "UPDATE red_packets SET status = 'refunded' WHERE id = %s", (other.packet_id,)
                ),
                idempotent=False,
            )
        amount = share + 1 if odd_one == "amount_elsewhere" else share
        odd = CreditEntry(other.packet_id, odd.user_id, 1, amount, odd.grabbed_ms)
    outcomes = await credit_many(core.db, [first, odd, *rest])
    assert outcomes == ["credited", expected, *["credited"] * len(rest)]
    for c in [first, *rest]:
        assert await ledger.balance(core.db, c.user_id) == c.amount
    odd_paid = odd.amount if expected in ("already", "credited") else 0
    paid = await core.db.fetchone(
        "SELECT COUNT(*), COALESCE(SUM(amount), 0) FROM journal WHERE kind = 'grab'"
    )
    assert paid is not None
    assert (int(paid[0]), int(paid[1])) == (
        len(rest) + 1 + (odd_paid > 0),
        first.amount + sum(c.amount for c in rest) + odd_paid,
    )
    assert await ledger.balance(core.db, odd.user_id) == odd_paid
    refused = await core.db.fetchall("SELECT code FROM credit_refusals")
    assert [str(r[0]) for r in refused] == ([] if odd_paid else [expected])
    await assert_books_balance(core)


async def _one_share_packet_beside(core: Core, pid: int) -> packets.Packet:
    """Another packet of one share (100 cents) in the same group as ``pid``, sent by its admin."""
    return await packets.send_packet(
        core,
        sender_id=await _admin(core),
        group_id=await _group_of(core, pid),
        kind="lucky",
        total=100,
        count=1,
    )


async def _each_share_paid_once(core: Core, pid: int, credits: list[CreditEntry]) -> None:
    """Every share of ``credits`` has one grab record, each grabber its amount, and the books agree."""
    rows = await core.db.fetchall(
        "SELECT seq, COUNT(*) FROM grab_records WHERE packet_id = %s GROUP BY seq", (pid,)
    )
    assert sorted((int(s), int(n)) for s, n in rows) == sorted((c.seq, 1) for c in credits)
    for c in credits:
        assert await ledger.balance(core.db, c.user_id) == c.amount
    assert (await reconcile(core)).ok
    await assert_books_balance(core)


def _pay_after_read(
    monkeypatch: pytest.MonkeyPatch, core: Core, marker: str, victim: CreditEntry
) -> list[int]:
    """Make another payer pay ``victim`` behind the packet's lock right after the batch's first read whose
    statement holds ``marker``; the list says it happened (``[1]``)."""
    injected: list[int] = []
    real_fetchall = Tx.fetchall

    async def fetchall_then_pay(tx: Tx, statement: str, params: object = ()) -> list[tuple[object, ...]]:
        rows = await real_fetchall(tx, statement, params)  # type: ignore[arg-type]
        if marker in statement and not injected:
            injected.append(await asyncio.to_thread(_pay_behind_the_lock, core.settings.database_url, victim))
        return rows

    monkeypatch.setattr(Tx, "fetchall", fetchall_then_pay)
    return injected


async def _count_its_share(core: Core, c: CreditEntry) -> None:
    """The packet's count of shares paid raised for ``c``, as the payer behind the lock does once the
    batch has let go of the packet's row (the count is written under that lock: it could not before)."""
    async with core.db.transaction() as tx:
        await tx.execute(
            "UPDATE red_packets SET credited_count = credited_count + 1 WHERE id = %s", (c.packet_id,)
        )


def _pay_behind_the_lock(database_url: str, c: CreditEntry) -> int:
    """Pay ``c`` on a connection of its own, as a payer that skips the packet's row lock would."""
    conn = side_session(database_url)
    try:
        with conn.cursor() as cur:
            cur.execute(
                "INSERT INTO grab_records (packet_id, user_id, seq, amount, status, grabbed_ms, credited_ms)"
                " VALUES (%s, %s, %s, %s, 'credited', %s, %s)",
                (c.packet_id, c.user_id, c.seq, c.amount, c.grabbed_ms, c.grabbed_ms),
            )
            cur.execute(
                "INSERT INTO journal (account_id, amount, kind, idem_key, packet_id, created_ms)"
                " VALUES (%s, %s, 'grab', %s, %s, %s)",
                (c.user_id, c.amount, f"grab:{c.packet_id}:{c.seq}", c.packet_id, c.grabbed_ms),
            )
            # (and its event, as every payer writes one with its journal row: server.money.events)
            cur.execute(
                "INSERT INTO events (type, idem_key, user_id, amount, body, created_ms, shard_id)"
                " VALUES ('share.credited', %s, %s, %s, '{}', %s, %s)",
                (f"grab:{c.packet_id}:{c.seq}", c.user_id, c.amount, c.grabbed_ms, c.user_id),
            )
            changed = cur.execute(
                "UPDATE accounts SET balance = balance + %s WHERE user_id = %s", (c.amount, c.user_id)
            )
        conn.commit()
        return int(changed)
    finally:
        conn.close()


async def test_a_batch_refuses_a_second_share_for_a_user_and_any_share_of_a_refunded_packet(
    core: Core,
) -> None:
    """Decided inside one batch, recorded in its transaction: a credit for a user who already holds
    another share of the packet, and a credit of a packet refunded before it came."""
    pid, credits, members = await _grabs(core, 4, 4_000)
    first, second, third, fourth = credits
    await credit_many(core.db, [first])
    refunded = await _one_share_packet_beside(core, pid)

    async def refund(tx: Tx) -> int:
        return await tx.execute(
            "UPDATE red_packets SET status = 'refunded' WHERE id = %s", (refunded.packet_id,)
        )

    await core.db.run(refund, idempotent=False)
    late = CreditEntry(
        refunded.packet_id, members[1], 1, await _share(core, refunded.packet_id, 1), first.grabbed_ms
    )
    greedy = CreditEntry(
        pid, first.user_id, third.seq, third.amount, first.grabbed_ms
    )  # first holds a share already
    outcomes = await credit_many(core.db, [greedy, second, late, fourth])
    assert outcomes == [errors.SHARE_CONFLICT, "credited", errors.PACKET_EXPIRED, "credited"]
    rows = await core.db.fetchall("SELECT packet_id, user_id, seq, code FROM credit_refusals")
    assert sorted((int(p), int(u), int(s), str(c)) for p, u, s, c in rows) == sorted(
        [
            (pid, first.user_id, third.seq, errors.SHARE_CONFLICT),
            (refunded.packet_id, members[1], 1, errors.PACKET_EXPIRED),
        ]
    )
    assert await ledger.balance(core.db, first.user_id) == first.amount
    assert {"credit_refused"} <= (await reconcile(core)).checks()


async def _admin(core: Core) -> int:
    row = await core.db.fetchone("SELECT id FROM users WHERE name = 'admin'")
    assert row is not None
    return int(row[0])


async def _group_of(core: Core, packet_id: int) -> int:
    row = await core.db.fetchone("SELECT group_id FROM red_packets WHERE id = %s", (packet_id,))
    assert row is not None
    return int(row[0])


async def _share(core: Core, packet_id: int, seq: int) -> int:
    row = await core.db.fetchone(
        "SELECT amount FROM red_packet_shares WHERE packet_id = %s AND seq = %s", (packet_id, seq)
    )
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize("core", ["sqlite", "mysql"], indirect=True)
async def test_a_grab_key_taken_in_the_journal_is_refused_and_the_rest_of_the_batch_is_paid(
    core: Core,
) -> None:
    """A grab's journal key (``grab:<packet>:<seq>``) already posted to another account: that credit is
    refused (``idempotency_key_reused``, recorded, reconciliation reports it) and the batch's other
    credits are paid — not a batch that fails on the key for ever and holds the drain. The same key
    posted to the grabber for that amount is a credit paid before: ``already``, not posted twice."""
    pid, credits, _ = await _grabs(core, members=3, total=300)
    poisoned, same, good = credits
    stranger = await ledger.create_user(core.db, "stranger")

    async def take_keys(tx: Tx) -> None:
        await tx.execute(  # (stray rows, as no code of ours writes them)
            "INSERT INTO journal (account_id, amount, kind, idem_key, packet_id, created_ms)"
            " VALUES (%s, %s, 'grab', %s, %s, 0), (%s, %s, 'grab', %s, %s, 0)",
            (
                *(stranger, poisoned.amount, ledger.grab_key(pid, poisoned.seq), pid),
                *(same.user_id, same.amount, ledger.grab_key(pid, same.seq), pid),
            ),
        )

    await core.db.run(take_keys, idempotent=False)
    got = await credit_many(core.db, [poisoned, poisoned, same, good])  # (a copy of the refused one too)
    assert [str(o) for o in got] == [errors.IDEMPOTENCY_KEY_REUSED] * 2 + ["already", "credited"]
    assert await ledger.balance(core.db, good.user_id) == good.amount
    assert await ledger.balance(core.db, poisoned.user_id) == 0
    row = await core.db.fetchone("SELECT code FROM credit_refusals WHERE seq = %s", (poisoned.seq,))
    assert row is not None and row[0] == errors.IDEMPOTENCY_KEY_REUSED
    assert not (await reconcile(core)).ok  # a stray journal row: reported


@pytest.mark.parametrize("core", ["sqlite", "mysql"], indirect=True)
async def test_a_last_share_found_paid_in_the_journal_still_finishes_its_packet(core: Core) -> None:
    """The last share's credit found its journal row there (``already``: its record written, nothing
    posted twice): the packet is finished by that transaction all the same, not left active until its
    refund."""
    pid, credits, _ = await _grabs(core, members=3, total=300)
    assert await credit_many(core.db, credits[:2]) == ["credited", "credited"]
    last = credits[2]

    async def post_it(tx: Tx) -> None:
        await tx.execute(
            "INSERT INTO journal (account_id, amount, kind, idem_key, packet_id, created_ms)"
            " VALUES (%s, %s, 'grab', %s, %s, 0)",
            (last.user_id, last.amount, ledger.grab_key(pid, last.seq), pid),
        )

    await core.db.run(post_it, idempotent=False)
    assert await credit_many(core.db, [last]) == ["already"]
    row = await core.db.fetchone("SELECT status FROM red_packets WHERE id = %s", (pid,))
    assert row is not None and row[0] == "finished"
