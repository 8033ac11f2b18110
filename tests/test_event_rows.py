"""A credit batch's ``share.credited`` events are one row, read back one event per credit from the
batch's journal rows (``server.money.events``): numbered without gaps, paged and looked up mid-row as any
event, queued for webhooks one delivery per credit, and reconciled against the journal — every way the
row and its journal rows can disagree is reported by name. On SQLite, MariaDB and a sharded ledger."""

from __future__ import annotations

from typing import Any

import pytest

from server.core import Core
from server.money import deliveries, events, ledger, packets
from server.money.crediting import credit_many
from server.money.events import grab_key
from server.money.reconcile import reconcile
from server.store.db import as_text
from server.store.records import CreditEntry
from server.store.shards import shard_of
from tests.conftest import World, make_world


async def _credited_packet(
    core: Core, count: int = 5, w: World | None = None
) -> tuple[int, list[CreditEntry]]:
    """A packet of ``count`` shares in ``w`` (a world of its own if None), every share credited in one
    batch; (its packet, the credits)."""
    w = w or await make_world(core, members=count)
    p = await packets.send_packet(
        core, sender_id=w.admin, group_id=w.group, kind="lucky", total=1_000, count=count
    )
    shares = await core.db.fetchall(
        "SELECT seq, amount FROM red_packet_shares WHERE packet_id = %s ORDER BY seq", (p.packet_id,)
    )
    credits = [
        CreditEntry(p.packet_id, u, int(s), int(a), 1) for u, (s, a) in zip(w.members, shares, strict=True)
    ]
    assert await credit_many(core.db, credits) == ["credited"] * count
    return p.packet_id, credits


async def _rows(core: Core) -> list[tuple[Any, ...]]:
    return await core.db.fetchall("SELECT idem_key, n, amount, tx FROM events WHERE type = 'share.credited'")


async def test_a_batch_of_credits_is_one_row_read_back_as_one_event_per_credit(core: Core) -> None:
    packet, credits = await _credited_packet(core)
    rows = await _rows(core)
    # One row for the batch's transaction (on a sharded ledger, one per users' shard: a transaction each).
    assert len(rows) == (
        1 if not core.db.shards else len({shard_of(c.user_id, core.db.shards) for c in credits})
    )
    assert sum(int(r[1]) for r in rows) == 5 and sum(int(r[2]) for r in rows) == 1_000
    every = await events.page(core.db, after=0, limit=500)
    credited = [e for e in every if e["type"] == "share.credited"]
    ids = [e["id"] for e in every]
    assert ids == list(range(ids[0], ids[0] + len(every)))  # no gap, no repeat (the counter is kept)
    first = credited[0]["id"]
    assert [e["id"] for e in credited] == list(range(first, first + 5))
    by_share = {e["data"]["seq"]: e for e in credited}
    for c in credits:  # each credit's own event, as the journal row says it
        e = by_share[c.seq]
        assert e["user_id"] == c.user_id
        assert e["data"] == {"amount": c.amount, "packet_id": packet, "seq": c.seq, "user_id": c.user_id}

    # Paged from the middle of the row, cut in the middle of it, looked up inside it.
    assert [e["id"] for e in await events.page(core.db, after=first + 1, limit=2)] == [first + 2, first + 3]
    found = await events.by_seq(core.db, [first + 4, first + 1, ids[0], 10**9])
    assert sorted(found) == sorted([first + 4, first + 1, ids[0]])
    assert found[first + 4] == credited[4] and found[ids[0]] == every[0]
    assert await events.seq_at(core.db, 0) == ids[0] - 1  # (the seq before the first event)


async def test_each_credit_of_a_row_is_its_own_delivery_and_a_replay_by_type_sends_them_again(
    core: Core,
) -> None:
    await _credited_packet(core, 4)
    await events.sequence(core.db)
    every = await events.page(core.db, after=0, limit=500)
    credited = [e for e in every if e["type"] == "share.credited"]
    assert await deliveries.queue(core.db, "only-credits", 1, ["share.credited"]) == 4
    token, claimed = await deliveries.claim(core.db, "only-credits", 2, 60_000, 100)
    assert [c.event for c in claimed] == credited  # (four users: none waits for another)
    for c in claimed:
        assert await deliveries.ack(core.db, "only-credits", c.seq, token, 3)
    listed = await deliveries.listing(core.db, "only-credits", after=0, limit=50)
    assert [(d["event_id"], d["type"], d["status"]) for d in listed] == [
        (e["id"], "share.credited", "delivered") for e in credited
    ]
    # Sent again by type; a URL that took only sends, replayed for every type, is given the row's
    # events it never queued, one delivery each.
    assert await deliveries.replay(core.db, ["only-credits"], 0, 4, {"only-credits": ["share.credited"]}) == 4
    assert await deliveries.queue(core.db, "sends", 4, ["packet.sent"]) == 1
    assert await deliveries.replay(core.db, ["sends"], 0, 5, {"sends": None}) == len(every)
    _, again = await deliveries.claim(core.db, "sends", 6, 60_000, 100)
    assert [c.event for c in again if c.event["type"] == "share.credited"] == credited


@pytest.mark.parametrize(
    "tamper, check",
    [
        ("DELETE FROM events WHERE type = 'share.credited'", "event_missing"),
        ("UPDATE events SET n = n - 1 WHERE type = 'share.credited'", "event_credits"),
        ("UPDATE events SET amount = amount + 1 WHERE type = 'share.credited'", "event_credits"),
        ("UPDATE events SET type = 'account.topup' WHERE tx IS NOT NULL", "event_untrue"),
        ("UPDATE journal SET tx = tx + 1 WHERE kind = 'grab' AND amount = (SELECT MAX(amount) FROM"
         " (SELECT amount FROM journal WHERE kind = 'grab') m)", "event_missing"),
    ],
    ids=["row-lost", "fewer-events", "other-cents", "other-type", "a-credit-moved-out"],
)  # fmt: skip
async def test_reconcile_names_a_row_of_credits_that_disagrees_with_its_journal_rows(
    core: Core, tamper: str, check: str
) -> None:
    await _credited_packet(core)
    assert (await reconcile(core)).ok
    await core.db.run(lambda tx: tx.execute(tamper), idempotent=False)
    report = await reconcile(core)
    assert check in report.checks(), report.differences


async def test_older_grab_rows_carrying_the_same_token_are_not_this_rows_events(core: Core) -> None:
    """A token is random: once in 2^63 an older transaction's grab rows (from before credits were one
    row, each with its own event) carry it too. Matched by token and time, the row reads back its own."""
    w = await make_world(core, members=3)
    _, older = await _credited_packet(core, 3, w)  # (made first: its journal rows come first by id)
    _, mine = await _credited_packet(core, 3, w)
    rows = await core.db.fetchall("SELECT tx, created_ms FROM events WHERE tx IS NOT NULL ORDER BY id")
    (old_token, _), (token, _) = rows[0], rows[-1]
    if core.db.shards:
        pytest.skip("a sharded batch is one row per users' shard: the rows of one token are chosen here")

    async def as_before_credits_were_one_row(tx: Any) -> None:
        await tx.execute("DELETE FROM events WHERE tx = %s", (old_token,))
        posted = await tx.fetchall(
            "SELECT idem_key, account_id, amount FROM journal WHERE tx = %s AND kind = 'grab'", (old_token,)
        )
        for key, account, amount in posted:  # each credit its own event, as migration 12's code wrote
            await tx.execute(
                "INSERT INTO events (type, idem_key, user_id, amount, body, created_ms, shard_id)"
                " VALUES ('share.credited', %s, %s, %s, '{}', 1, %s)",
                (as_text(key), account, amount, account),
            )
        await tx.execute("UPDATE journal SET tx = %s, created_ms = 1 WHERE tx = %s", (token, old_token))

    await core.db.run(as_before_credits_were_one_row, idempotent=False)
    report = await reconcile(core)
    assert report.ok, report.differences
    credited = [e for e in await events.page(core.db, after=0, limit=500) if e["type"] == "share.credited"]
    from_row = [(e["data"]["packet_id"], e["user_id"], e["data"]["seq"]) for e in credited if e["data"]]
    assert from_row == [(c.packet_id, c.user_id, c.seq) for c in mine]
    assert len(credited) == 6 and len(older) == 3
    # And an older row's own event lost is still missed: the row of the same token is not its event.
    lost = grab_key(older[0].packet_id, older[0].seq)
    await core.db.run(
        lambda tx: tx.execute("DELETE FROM events WHERE idem_key = %s", (lost,)), idempotent=False
    )
    assert [d.check for d in (await reconcile(core)).differences] == ["event_missing"]


async def test_a_row_whose_journal_rows_are_gone_does_not_stop_the_readers_after_it(core: Core) -> None:
    w = await make_world(core, members=3)
    await _credited_packet(core, 3, w)
    await core.db.run(
        lambda tx: tx.execute("UPDATE events SET tx = tx + 1 WHERE tx IS NOT NULL"), idempotent=False
    )
    await ledger.topup(core.db, w.admin, 100, "after-the-broken-row")
    await events.sequence(core.db)
    last = await events.last_seq(core.db)
    [(first,)] = await core.db.fetchall("SELECT MIN(seq - n) FROM events WHERE tx IS NOT NULL")
    after_it = [e["type"] for e in await events.page(core.db, after=int(first), limit=3)]
    assert after_it == ["packet.finished", "account.topup"]  # (the credits' events cannot be read)
    assert await deliveries.queue(core.db, "after", 1, ["account.topup"]) == 2  # the seed's and this one
    assert await deliveries.last_queued(core.db, "after") == last
    assert "event_credits" in (await reconcile(core)).checks()
