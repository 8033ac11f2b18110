"""The values Redis holds about shares and grabs, each format written here once.

A share in a packet's list is ``"<seq>:<amount>"``; a grab in its grabs hash is the share it popped and
when, ``"<seq>:<amount>:<grabbed_ms>"``; a credit in the shard's outbox names the packet, the grabber and
the group around that, ``"<packet>:<user>:<seq>:<amount>:<grabbed_ms>:<group>"``; a grab a repair took
out is kept as ``"<user>:<seq>:<amount>:<grabbed_ms>"``. Each is built from the one before, so the
formats cannot drift apart here.

The Lua scripts build and read the same strings (``lua/grab.lua`` writes the grab and its credit,
``lua/load_packet.lua`` the dropped grabs, ``lua/ack_credits.lua`` a grab from a paid credit): the tests
in ``tests/unit/test_records.py`` and ``tests/test_credit.py`` parse what the real scripts wrote with the
classes below and encode it back to the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from server.ids import GroupId, PacketId, ShareSeq, UserId

# A credit's group when only the ledger will read it.
NO_GROUP = GroupId(0)


def _fields(raw: bytes | str, n: int, what: str) -> list[int]:
    """The ``n`` whole numbers of a value; ``ValueError`` naming ``what`` for anything else. (Read on
    every grab's answer: split and converted as bytes, without decoding first.)"""
    parts = raw.split(b":") if isinstance(raw, bytes) else raw.split(":")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if len(values) != n or min(values) < 0:
        raise ValueError(f"not a {what}: {raw!r}")
    return values


def share_text(seq: int, amount: int) -> str:
    """A share as its packet's list holds it (``ShareEntry.encode``, without making one)."""
    return f"{seq}:{amount}"


@dataclass(frozen=True)
class ShareEntry:
    """A share not yet taken, as its packet's list holds it."""

    seq: ShareSeq
    amount: int

    def encode(self) -> str:
        return share_text(self.seq, self.amount)

    @classmethod
    def parse(cls, raw: bytes | str) -> ShareEntry:
        seq, amount = _fields(raw, 2, "share entry")
        return cls(ShareSeq(seq), amount)


@dataclass(frozen=True)
class GrabRecord:
    """Who took which share, as the packet's grabs hash holds it (the user is the hash's field)."""

    seq: ShareSeq
    amount: int
    grabbed_ms: int

    def encode(self) -> str:
        return f"{ShareEntry(self.seq, self.amount).encode()}:{self.grabbed_ms}"

    @classmethod
    def parse(cls, raw: bytes | str) -> GrabRecord:
        seq, amount, ms = _fields(raw, 3, "grab record")
        return cls(ShareSeq(seq), amount, ms)


class CreditEntry(NamedTuple):
    """A credit waiting in the shard's outbox (field ``c`` of a stream entry). A named tuple, not a frozen
    dataclass like the others: the credit drain parses hundreds a batch, and a tuple is made in a quarter
    of the time (0.26 against 1.0 µs)."""

    packet_id: PacketId
    user_id: UserId
    seq: ShareSeq
    amount: int
    grabbed_ms: int
    # Where the packet's Redis keys are (``server.store.keys``); the ledger needs none (a credit built for
    # the database alone may leave it 0).
    group_id: GroupId = NO_GROUP

    @property
    def record(self) -> GrabRecord:
        return GrabRecord(self.seq, self.amount, self.grabbed_ms)

    def share(self) -> str:
        """Its share as the packet's list holds it."""
        return share_text(self.seq, self.amount)

    def encode(self) -> str:
        return f"{self.packet_id}:{self.user_id}:{self.record.encode()}:{self.group_id}"

    @classmethod
    def parse(cls, raw: bytes | str) -> CreditEntry:
        # (packet, user, seq, amount, grabbed_ms, group): the fields in order, the ids' types being ints.
        return cls._make(_fields(raw, 6, "credit entry"))


@dataclass(frozen=True)
class DroppedEntry:
    """A grab a repair took out of its packet (the database holds its share, or its user, otherwise)."""

    user_id: UserId
    record: GrabRecord

    def encode(self) -> str:
        return f"{self.user_id}:{self.record.encode()}"

    @classmethod
    def parse(cls, raw: bytes | str) -> DroppedEntry:
        user, seq, amount, ms = _fields(raw, 4, "dropped grab")
        return cls(UserId(user), GrabRecord(ShareSeq(seq), amount, ms))
