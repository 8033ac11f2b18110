"""Packet and grab-record statuses are a closed set (``server.money.statuses``): a row with a status no
code of ours writes is refused where it is read, not taken for one it resembles."""

from __future__ import annotations

import pytest

from server.money.creditrules import Held, decide
from server.money.packetrows import PACKET_COLUMNS, packet_from_row
from server.money.statuses import PacketStatus, RecordStatus
from server.store.records import CreditEntry


def _row(status: str) -> tuple[object, ...]:
    values = {
        "id": 7, "sender_id": 1, "group_id": 2, "kind": "equal", "total": 100, "share_count": 2,
        "greeting": "", "target_user_id": None, "status": status, "request_id": None, "created_ms": 1,
        "expires_ms": 2, "finished_ms": None, "announced_ms": None, "seed": "00" * 32,
    }  # fmt: skip
    return tuple(values[c] for c in PACKET_COLUMNS.split(", "))


def test_a_packet_row_is_read_into_its_status_and_an_unknown_one_refused() -> None:
    assert packet_from_row(_row("refunding")).status is PacketStatus.REFUNDING
    with pytest.raises(ValueError, match="actve"):
        packet_from_row(_row("actve"))


def test_the_credit_rules_see_statuses_by_member_not_by_spelling() -> None:
    """A record already credited is "already"; one mid-step (``crediting``) is paid even on a refunded
    packet; a new credit on a refunded packet is refused."""
    c = [CreditEntry(7, 3, 1, 60, 0, 2), CreditEntry(7, 4, 2, 40, 0, 2)]
    held = Held(shares={(7, 1): 60, (7, 2): 40})
    held.by_seq[(7, 1)] = (3, RecordStatus.CREDITED)
    held.by_user[(7, 3)] = 1
    out, inserts, updates = decide(c, {7: PacketStatus.REFUNDED}, held, set())
    assert (out[0], str(out[1]), inserts, updates) == ("already", "packet_expired", [], [])
    held.by_seq[(7, 1)] = (3, RecordStatus.CREDITING)
    out, inserts, updates = decide(c[:1], {7: PacketStatus.REFUNDED}, held, set())
    assert (out, updates) == (["credited"], c[:1])
