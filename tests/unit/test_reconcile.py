"""Reconciliation's pure arithmetic on hand-made books (``server.money.reconcile.check``): books in order
have no difference, every way the money can go wrong is one, and its report reads back from JSON the same.
(Real books spoiled in the database and in Redis: ``tests/test_reconcile.py``.)"""

from __future__ import annotations

import dataclasses
import json

import pytest

from server.money.reconcile import LATE_MS, Books, GrabRow, PacketBooks, Posting, check
from server.money.reconcilereport import from_json, to_json

NOW = 10 * LATE_MS


def _books(**changes: object) -> Books:
    """One packet of 100 in two shares, 60 paid to user 2, 40 held; user 1 sent it from a top-up of 100."""
    packet = PacketBooks(
        packet_id=7,
        status="active",
        total=100,
        debited=100,
        credited=60,
        refunded=0,
        credited_records=60,
        records_paid=1,
        credited_count=1,
        count=2,
        shares_total=100,
        shares_count=2,
        expires_ms=NOW + 1,
    )
    books = Books(
        packets=[packet],
        accounts=[(1, 0, 0), (2, 60, 60)],
        topups=100,
        redis_grabs={7: [GrabRow(7, 2, 1, 60, NOW - 1)]},
        db_grabs={7: [GrabRow(7, 2, 1, 60)]},
        now_ms=NOW,
    )
    packet_changes = {k[2:]: v for k, v in changes.items() if k.startswith("p_")}
    if packet_changes:
        books = dataclasses.replace(books, packets=[dataclasses.replace(packet, **packet_changes)])  # type: ignore[arg-type]
    return dataclasses.replace(books, **{k: v for k, v in changes.items() if not k.startswith("p_")})  # type: ignore[arg-type]


def test_books_in_order_have_no_difference() -> None:
    report = check(_books())
    assert report.ok, report.differences
    assert (report.money_in, report.in_balances, report.held_in_packets) == (100, 60, 40)


@pytest.mark.parametrize(
    ("spoiled", "found"),
    [
        ({"p_shares_total": 99}, "packet_shares"),
        ({"p_shares_count": 3}, "packet_shares"),
        ({"p_debited": 200}, "packet_debit"),
        ({"p_credited_count": 2}, "packet_paid_count"),  # the row says both shares are paid
        ({"p_credited_count": 0}, "packet_paid_count"),
        ({"p_status": "refunding", "p_expires_ms": NOW - LATE_MS - 1}, "packet_stuck"),
        ({"p_status": "active", "p_expires_ms": NOW - LATE_MS - 1}, "packet_stuck"),
        ({"p_status": "actve"}, "packet_status"),  # a status no code of ours writes
        ({"wrong_account": [Posting(7, "refund", 2, 40, 1)]}, "posting_account"),
        ({"grab_postings_unmatched": [GrabRow(7, 3, 0, 60)]}, "grab_posting"),
        ({"records_unposted": [GrabRow(7, 2, 1, 60)]}, "grab_posting"),
        ({"records_off_share": [GrabRow(7, 2, 1, 60, note="59")]}, "grab_share"),
        ({"refused": [GrabRow(7, 3, 2, 40, note="packet_expired, by drain")]}, "credit_refused"),
        ({"repeated": [(12345, 2)]}, "repeated_posting"),
        ({"redis_grabs": {7: [GrabRow(7, 2, 2, 40, NOW - 1)]}}, "redis_grab"),  # the ledger has share 1
        ({"redis_grabs": {7: [GrabRow(7, 2, 1, 60), GrabRow(7, 3, 1, 60)]}}, "redis_grab"),  # told twice
        (
            {"redis_grabs": {7: [GrabRow(7, 2, 1, 60), GrabRow(7, 3, 2, 40, NOW - LATE_MS - 1)]}},
            "redis_grab_unpaid",
        ),
        ({"redis_error": "cannot read Redis: gone"}, "redis_unreadable"),
    ],
)
def test_each_way_the_money_can_go_wrong_is_a_difference(spoiled: dict[str, object], found: str) -> None:
    assert found in check(_books(**spoiled)).checks()


def test_a_young_unpaid_grab_and_a_packet_expired_just_now_are_not_differences() -> None:
    """Crediting takes seconds and the refund job runs every minute: only LATE_MS later is it late."""
    young = {7: [GrabRow(7, 2, 1, 60), GrabRow(7, 3, 2, 40, NOW - LATE_MS + 1)]}
    assert check(_books(redis_grabs=young, p_expires_ms=NOW - LATE_MS + 1)).ok


def test_a_report_as_json_reads_back_the_same() -> None:
    """``redpacket reconcile --json``'s report, as the worker reads it back from its child process: every
    figure and difference the same; anything else refused."""
    report = dataclasses.replace(check(_books(topups=101)), shards=["shard 0: ..."])
    assert report.differences
    text = to_json(report)
    assert json.loads(text)["ok"] is False
    assert from_json(text) == report
    for garbage in ("", "[]", '{"ok": true}', to_json(report).replace('"check"', '"kind"')):
        with pytest.raises(ValueError, match="not a reconciliation report"):
            from_json(garbage)
