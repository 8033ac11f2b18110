"""A packet's row: its columns, the ``Packet`` read from it, and the rows a send inserts (its own module:
the one-transaction send and the shard-local one, ``server.money.packets``, both write them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

from redpacket_client.fairness import Kind, commitment, fair_shares
from server.ids import GroupId, PacketId, UserId
from server.money.split import PacketRequest
from server.money.statuses import PacketStatus
from server.store.db import IntegrityError, Row, Tx

# A packet's columns as ``packet_from_row`` reads them, by name (a query selects ``PACKET_COLUMNS``).
_COLUMNS = (
    "id sender_id group_id kind total share_count greeting target_user_id status request_id created_ms"
    " expires_ms finished_ms announced_ms seed"
).split()
PACKET_COLUMNS = ", ".join(_COLUMNS)


@dataclass(frozen=True)
class Packet:
    packet_id: PacketId
    sender_id: UserId
    group_id: GroupId
    kind: Kind
    total: int
    count: int
    greeting: str
    target_user_id: UserId | None
    status: PacketStatus
    created_ms: int
    expires_ms: int
    # False when Redis could not be reached at send: the money is safe in the database and
    # ``recover_packet`` (or the first grab) brings the packet up.
    published: bool = True
    # True when ``request_id`` matched an earlier send: nothing new was debited.
    replay: bool = False
    # When its event was published to the group (``server.live.announce``); None until then.
    announced_ms: int | None = None
    # What its shares were drawn from (``redpacket_client.fairness``); None for a packet sent before packets
    # were provably fair. Secret while the packet is active: never in a repr, a log or a reply.
    seed: bytes | None = field(default=None, repr=False)
    # When its last share was grabbed (finished), or its refund decided; None while it is open.
    finished_ms: int | None = None

    @property
    def commitment(self) -> str | None:
        """``sha256(seed)``, published from the send on; None when the packet has no seed."""
        return None if self.seed is None else commitment(self.seed)

    def shares(self) -> list[int]:
        """Its shares in the order they are handed out, drawn again from its seed."""
        if self.seed is None:
            raise ValueError(f"packet {self.packet_id} has no seed: its shares are only in the database")
        return fair_shares(self.seed, self.packet_id, self.kind, self.total, self.count)


def packet_from_row(row: Row) -> Packet:
    """The packet a row of ``SELECT {PACKET_COLUMNS}`` holds, read by column name."""
    r = dict(zip(_COLUMNS, row, strict=True))
    return Packet(
        packet_id=PacketId(int(r["id"])),
        sender_id=UserId(int(r["sender_id"])),
        group_id=GroupId(int(r["group_id"])),
        kind=r["kind"],
        total=int(r["total"]),
        count=int(r["share_count"]),
        greeting=str(r["greeting"]),
        target_user_id=None if r["target_user_id"] is None else UserId(int(r["target_user_id"])),
        status=PacketStatus(r["status"]),
        created_ms=int(r["created_ms"]),
        expires_ms=int(r["expires_ms"]),
        announced_ms=None if r["announced_ms"] is None else int(r["announced_ms"]),
        seed=None if r["seed"] is None else bytes.fromhex(str(r["seed"])),
        finished_ms=None if r["finished_ms"] is None else int(r["finished_ms"]),
    )


class PacketKeyTaken(Exception):
    """The packet's own row met a unique key: its id, or its sender's request id, is another row's (a
    call of the same request, or a ``void`` row). Only this: a failure of its shares' insert is no such
    thing, and must not be taken for a row made elsewhere (the row this transaction just wrote is there)."""


async def packet_rows(
    tx: Tx,
    req: PacketRequest,
    key: str,
    seed: bytes,
    sender_id: UserId,
    group_id: GroupId,
    created: int,
    expires: int,
    packet_id: PacketId | None = None,
) -> PacketId:
    """Insert the packet's row (with ``packet_id``, or a new id) and its shares, drawn from ``seed`` once
    the id is known (``redpacket_client.fairness``); return its id."""
    given = "id, " if packet_id else ""
    try:
        await tx.execute(
            f"INSERT INTO red_packets ({given}sender_id, group_id, kind, total, share_count, greeting,"
            " target_user_id, status, request_id, created_ms, expires_ms, seed, credited_count)"
            f" VALUES ({given and '%s, '}%s, %s, %s, %s, %s, %s, %s, '{PacketStatus.ACTIVE}',"
            " %s, %s, %s, %s, 0)",
            (
                *([packet_id] if packet_id else []),
                *(sender_id, group_id, req.kind, req.total, req.count, req.greeting, req.target_user_id),
                *(key, created, expires, seed.hex()),
            ),
        )
    except IntegrityError:
        raise PacketKeyTaken from None
    if packet_id is None and tx.lastrowid is None:
        raise RuntimeError("the database returned no id for the new packet")
    pid = packet_id or PacketId(cast(int, tx.lastrowid))
    shares = fair_shares(seed, pid, req.kind, req.total, req.count)
    await tx.executemany(
        "INSERT INTO red_packet_shares (packet_id, seq, amount) VALUES (%s, %s, %s)",
        [(pid, seq, amount) for seq, amount in enumerate(shares, start=1)],
    )
    return pid


def sent_data(
    packet_id: PacketId, req: PacketRequest, sender_id: UserId, group_id: GroupId, expires: int
) -> dict[str, object]:
    """The ``packet.sent`` event's data."""
    target = None if req.target_user_id is None else UserId(req.target_user_id)
    return {
        "packet_id": packet_id,
        "group_id": group_id,
        "sender_id": sender_id,
        "kind": req.kind,
        "total": req.total,
        "count": req.count,
        "target": target,
        "expires_ms": expires,
    }


def new_packet(
    packet_id: PacketId,
    req: PacketRequest,
    sender_id: UserId,
    group_id: GroupId,
    created: int,
    expires: int,
    seed: bytes,
) -> Packet:
    target = None if req.target_user_id is None else UserId(req.target_user_id)
    return Packet(
        packet_id=packet_id,
        sender_id=sender_id,
        group_id=group_id,
        kind=req.kind,
        total=req.total,
        count=req.count,
        greeting=req.greeting,
        target_user_id=target,
        status=PacketStatus.ACTIVE,
        created_ms=created,
        expires_ms=expires,
        seed=seed,
    )
