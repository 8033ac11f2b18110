"""The value formats Redis holds (server/store/records.py): each parses back to what was encoded, and a
malformed value is refused rather than read as something else. tests/test_credit.py holds the real
grab script's bytes to the same formats."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from server.ids import MAX_ID, GroupId, PacketId, ShareSeq, UserId
from server.store.records import CreditEntry, DroppedEntry, GrabRecord, ShareEntry

ids = st.integers(min_value=1, max_value=MAX_ID)
cents = st.integers(min_value=1, max_value=2**53)
ms = st.integers(min_value=0, max_value=2**48)


@given(ids, ids, st.integers(min_value=1, max_value=1000), cents, ms, ids)
def test_every_format_round_trips(packet: int, user: int, seq: int, amount: int, at: int, group: int) -> None:
    share = ShareEntry(ShareSeq(seq), amount)
    record = GrabRecord(ShareSeq(seq), amount, at)
    credit = CreditEntry(PacketId(packet), UserId(user), ShareSeq(seq), amount, at, GroupId(group))
    dropped = DroppedEntry(UserId(user), record)
    assert ShareEntry.parse(share.encode()) == share
    assert GrabRecord.parse(record.encode().encode()) == record
    assert CreditEntry.parse(credit.encode().encode()) == credit and credit.record == record
    assert DroppedEntry.parse(dropped.encode()) == dropped
    # Each is built from the one before: a grab record is its share and when; a credit wraps the record.
    assert record.encode().startswith(share.encode() + ":")
    assert credit.encode() == f"{packet}:{user}:{record.encode()}:{group}"


@pytest.mark.parametrize(
    ("kind", "raw"),
    [
        (GrabRecord, "1:500"),  # a share, not a grab
        (GrabRecord, "1:500:17:9"),
        (ShareEntry, "1:-5"),
        (CreditEntry, "7:8:1:500:17"),  # no group
        (CreditEntry, "7:8:1:500:17:x"),
        (DroppedEntry, b"8:1:500"),
    ],
)
def test_a_malformed_value_is_refused(kind: type, raw: str | bytes) -> None:
    with pytest.raises(ValueError, match="not a"):
        kind.parse(raw)
