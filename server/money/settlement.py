"""Settling packets: paying every grab Redis holds that the database has not, and refunding what nobody
took once a packet expires. Used by the sweeper and the refund jobs in ``worker/``.

A packet's life in the database: ``active`` → ``finished`` (every share credited) or, past its expiry,
``active`` → ``refunding`` (claimed by one worker, compare-and-set) → ``refunded``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import cast

from redis.exceptions import RedisError

from server.core import Core
from server.errors import RedPacketError
from server.money.grabs import parse_record
from server.money.ledger import Credit, credit_grab, finish_paid, now_ms, post
from server.store import keys
from server.store.db import Tx

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Settled:
    credited_now: int
    refused: int


async def settle(core: Core, packet_id: int, group_id: int) -> Settled:
    """Credit every grab of the packet that Redis holds and the database does not (idempotent).

    Cancelled half-way: the credits already committed stand; running it again pays the rest once.
    """
    try:
        held = await cast(
            Awaitable[dict[bytes, bytes]], core.redis.hgetall(keys.packet_grabs(group_id, packet_id))
        )
    except RedisError as e:
        log.warning(
            "packet %d: cannot read its grabs from Redis (%s); settling what the database has", packet_id, e
        )
        return Settled(0, 0)
    rows = await core.db.fetchall(
        "SELECT user_id FROM grab_records WHERE packet_id = %s AND status = 'credited'", (packet_id,)
    )
    paid = {int(r[0]) for r in rows}
    credited = refused = 0
    for user, record in held.items():
        uid = int(user)
        if uid in paid:
            continue
        g = parse_record(uid, record)
        try:
            if (
                await credit_grab(core.db, Credit(packet_id, uid, g.seq, g.amount, g.grabbed_ms))
                == "credited"
            ):
                credited += 1
        except RedPacketError as e:
            refused += 1
            log.error("packet %d: grab of user %d share %d not credited: %s", packet_id, uid, g.seq, e.code)
    return Settled(credited, refused)


@dataclass(frozen=True)
class Refund:
    packet_id: int
    outcome: str  # "refunded", "finished", "taken" (another worker has it), "not_due"
    amount: int = 0


async def refund_packet(core: Core, packet_id: int, now: int | None = None) -> Refund:
    """Close an expired packet: settle its grabs, give the sender back what nobody took, clean Redis.

    Two workers at once: the compare-and-set on the status lets one through. A worker that died after
    claiming leaves ``refunding``; running this again finishes the job (the refund's journal key is
    ``refund:<packet>``, so it is paid once). A grab made in the last moment before expiry is paid,
    not refunded: every grab Redis holds is settled before the refund is computed.
    """
    now = now_ms() if now is None else now

    async def claim(tx: Tx) -> int:
        return await tx.execute(
            "UPDATE red_packets SET status = 'refunding'"
            " WHERE id = %s AND status = 'active' AND expires_ms <= %s",
            (packet_id, now),
        )

    claimed = await core.db.run(claim)
    row = await core.db.fetchone("SELECT status, group_id FROM red_packets WHERE id = %s", (packet_id,))
    if row is None:
        return Refund(packet_id, "taken")
    group_id = int(row[1])
    if claimed == 0 and row[0] != "refunding":
        return Refund(packet_id, "not_due" if row[0] == "active" else "taken")
    # No grab may start after this point: the packet is closed in Redis before its grabs are read.
    try:
        await cast(Awaitable[int], core.redis.hset(keys.packet_meta(group_id, packet_id), "closed", "1"))
    except RedisError as e:
        log.warning("packet %d: could not close it in Redis (%s)", packet_id, e)
    await settle(core, packet_id, group_id)

    async def pay_back(tx: Tx) -> Refund:
        p = await tx.fetchone(
            "SELECT sender_id, total, status FROM red_packets WHERE id = %s" + tx.dialect.for_update,
            (packet_id,),
        )
        if p is None or p[2] != "refunding":
            return Refund(packet_id, "taken")
        sender, total = int(p[0]), int(p[1])
        row = await tx.fetchone(
            "SELECT COALESCE(SUM(amount), 0) FROM grab_records WHERE packet_id = %s AND status = 'credited'",
            (packet_id,),
        )
        left = total - int(row[0] if row else 0)
        if left < 0:
            raise RuntimeError(f"packet {packet_id} paid out more than its total")
        status = "refunded" if left else "finished"
        if left:
            await post(tx, sender, left, "refund", f"refund:{packet_id}", packet_id)
        await tx.execute(
            "UPDATE red_packets SET status = %s, finished_ms = %s WHERE id = %s", (status, now, packet_id)
        )
        return Refund(packet_id, status, left)

    result = await core.db.run(pay_back)
    if result.outcome in ("refunded", "finished"):
        try:
            await core.redis.delete(*keys.packet_keys(group_id, packet_id))
        except RedisError as e:
            log.warning("packet %d settled; its Redis keys stay until they expire (%s)", packet_id, e)
        log.info("packet %d %s, %d cents back to the sender", packet_id, result.outcome, result.amount)
    return result


async def due_for_refund(core: Core, now: int | None = None, limit: int = 500) -> list[int]:
    """Packets past their expiry not yet settled, and refunds a dead worker left half-way."""
    now = now_ms() if now is None else now
    rows = await core.db.fetchall(
        "SELECT id FROM red_packets WHERE (status = 'active' AND expires_ms <= %s) OR status = 'refunding'"
        " ORDER BY expires_ms LIMIT %s",
        (now, limit),
    )
    return [int(r[0]) for r in rows]


async def mark_finished(core: Core) -> int:
    """Active packets whose every share is credited become ``finished``; returns how many. (Crediting
    the last share does this already; this catches packets credited before it did.)"""
    rows = await core.db.fetchall(
        "SELECT id FROM red_packets WHERE status = 'active' AND share_count = (SELECT COUNT(*)"
        " FROM grab_records g WHERE g.packet_id = red_packets.id AND g.status = 'credited')"
    )
    ids = [int(r[0]) for r in rows]
    return await core.db.run(lambda tx: finish_paid(tx, ids)) if ids else 0


async def sweep(core: Core, now: int | None = None, window_ms: int = 26 * 3600 * 1000) -> Settled:
    """Credit grabs Redis recorded but the database never received (a hub died between the grab and
    the enqueue, or the enqueue failed), for every live packet of the window."""
    now = now_ms() if now is None else now
    rows = await core.db.fetchall(
        "SELECT id, group_id FROM red_packets WHERE status IN ('active', 'refunding') AND created_ms >= %s",
        (now - window_ms,),
    )
    credited = refused = 0
    for pid, gid in rows:
        s = await settle(core, int(pid), int(gid))
        credited += s.credited_now
        refused += s.refused
    return Settled(credited, refused)
