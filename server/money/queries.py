"""Reads of the packet tables the hub and the workers make beyond sending, grabbing and settling: a
packet's status and where each of its grabs stands in the ledger, a user's packets sent and received (in
pages), the open packets of a group, the newest journal row of an account, and the packets whose
``packet`` event is still to be published (with the mark that it was)."""

from __future__ import annotations

from server.ids import MAX_ID, GroupId, PacketId, UserId
from server.money.ledger import now_ms
from server.money.statuses import PacketStatus
from server.store.db import Database, Tx

_SENT = "packet_id group_id kind total count greeting status created_ms paid_out".split()
_RECEIVED = "packet_id group_id amount status grabbed_ms sender_id sender_name kind greeting".split()


async def packet_status(db: Database, packet_id: PacketId) -> tuple[GroupId, str] | None:
    """(its group, its status: active, refunding, finished, refunded), or None for no such packet."""
    row = await db.fetchone("SELECT group_id, status FROM red_packets WHERE id = %s", (packet_id,))
    return None if row is None else (GroupId(int(row[0])), str(row[1]))


async def grab_states(db: Database, packet_id: PacketId) -> dict[UserId, str]:
    """Each grabber's ledger state of their share (``crediting``, ``credited``); absent: not in the
    ledger yet (Redis holds it, the workers credit it)."""
    rows = await db.fetchall("SELECT user_id, status FROM grab_records WHERE packet_id = %s", (packet_id,))
    return {UserId(int(r[0])): str(r[1]) for r in rows}


async def sent_page(db: Database, user_id: UserId, *, before: int, limit: int) -> list[dict[str, object]]:
    """The user's packets sent, newest first, with what has been paid out of each: those with an id below
    ``before`` (0: from the newest), at most ``limit``."""
    rows = await db.fetchall(
        "SELECT p.id, p.group_id, p.kind, p.total, p.share_count, p.greeting, p.status, p.created_ms,"
        " (SELECT COUNT(*) FROM grab_records g WHERE g.packet_id = p.id)"
        " FROM red_packets p WHERE p.sender_id = %s AND p.id < %s ORDER BY p.id DESC LIMIT %s",
        (user_id, before or MAX_ID, limit),
    )
    return [dict(zip(_SENT, r, strict=True)) for r in rows]


async def received_page(db: Database, user_id: UserId, *, before: int, limit: int) -> list[dict[str, object]]:
    """The user's shares received, newest packet first: of packets with an id below ``before`` (0: from
    the newest), at most ``limit``."""
    rows = await db.fetchall(
        "SELECT g.packet_id, p.group_id, g.amount, g.status, g.grabbed_ms, p.sender_id, u.name, p.kind,"
        " p.greeting FROM grab_records g JOIN red_packets p ON p.id = g.packet_id"
        " JOIN users u ON u.id = p.sender_id"
        " WHERE g.user_id = %s AND g.packet_id < %s ORDER BY g.packet_id DESC LIMIT %s",
        (user_id, before or MAX_ID, limit),
    )
    return [dict(zip(_RECEIVED, r, strict=True)) for r in rows]


async def last_journal_id(db: Database, user_id: UserId) -> int:
    """The id of the account's newest journal row (0: none yet)."""
    row = await db.fetchone("SELECT MAX(id) FROM journal WHERE account_id = %s", (user_id,))
    return 0 if row is None or row[0] is None else int(row[0])


async def mark_announced(db: Database, packet_id: PacketId) -> None:
    """Record that the packet's ``packet`` event was published (``server.live.announce``)."""

    async def mark(tx: Tx) -> int:
        return await tx.execute(
            "UPDATE red_packets SET announced_ms = %s WHERE id = %s AND announced_ms IS NULL",
            (now_ms(), packet_id),
        )

    await db.run(mark, idempotent=True)


async def unannounced(db: Database, now: int, *, created_before: int, limit: int) -> list[PacketId]:
    """Live packets saved before ``created_before`` whose event was never published, oldest first."""
    rows = await db.fetchall(
        "SELECT id FROM red_packets WHERE announced_ms IS NULL AND created_ms <= %s"
        f" AND status = '{PacketStatus.ACTIVE}' AND expires_ms > %s ORDER BY id LIMIT %s",
        (created_before, now, limit),
    )
    return [PacketId(int(r[0])) for r in rows]


async def open_in_group(db: Database, group_id: GroupId, now: int, limit: int = 20) -> list[PacketId]:
    """The group's newest packets that are active and not expired, newest first."""
    rows = await db.fetchall(
        f"SELECT id FROM red_packets WHERE group_id = %s AND status = '{PacketStatus.ACTIVE}' AND"
        " expires_ms > %s"
        " ORDER BY id DESC LIMIT %s",
        (group_id, now, limit),
    )
    return [PacketId(int(r[0])) for r in rows]
