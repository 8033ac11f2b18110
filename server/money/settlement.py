"""Settling packets: paying every grab Redis holds that the database has not, and refunding what nobody
took once a packet expires. Used by the sweeper and the refund jobs in ``worker/``.

A packet's life in the database: ``active`` → ``finished`` (every share credited) or, past its expiry,
``active`` → ``refunding`` (claimed by one worker, compare-and-set) → ``refunded``.

A refund never runs on what the database alone says: it first closes the packet in Redis and reads its
grabs in the same atomic call (``lua/close_packet.lua``), made durable like a grab, and pays every one of
them before it computes what is left. While Redis cannot be reached the packet stays ``refunding`` (no
grab is answered for it: ``refunding`` is loaded as closed by any repair) and the next run tries again.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Literal, assert_never

from redis.exceptions import RedisError

from server import errors
from server.core import Core, unavailable
from server.errors import RedPacketError, Unavailable
from server.ids import PacketId
from server.money import shardsteps
from server.money.crediting import credit_or_record
from server.money.creditrules import Refusal, lock_packets, record_refusals
from server.money.journal import post_refund, refund_key
from server.money.ledger import finish_paid, finished_event, now_ms, recount_paid
from server.money.packets import (
    PACKET_COLUMNS,
    Packet,
    dropped_credit,
    load_packet,
    packet_from_row,
    recover_packet,
)
from server.money.shardsteps import StepsOutcome
from server.money.statuses import PacketStatus, RecordStatus
from server.store import keys
from server.store.db import Tx
from server.store.records import CreditEntry
from server.store.scriptcalls import ClosePacketCall, run
from server.store.shards import by_shard

log = logging.getLogger(__name__)

# The sweeper pays a grab Redis holds only once it is this old: younger ones are the drain's to pay.
STRANDED_MS = 60_000


@dataclass(frozen=True)
class Settled:
    credited_now: int
    refused: int


@dataclass(frozen=True)
class Seen:
    """What Redis holds of a packet, read in one atomic call: its grabs, and the grabs repairs dropped."""

    grabs: list[CreditEntry]
    dropped: list[CreditEntry]
    # Whether the packet's keys were there: if not, its grabs may be only in the outbox.
    present: bool = True


async def read_grabs(core: Core, p: Packet, close: bool) -> Seen:
    """Close the packet to grabs (``close``) or only mark it read, and read its grabs: one call in its
    slot, answered once what it read is as durable as a grab ("won" is never answered for less). Raises
    ``Unavailable`` when Redis cannot do it."""
    call = ClosePacketCall(
        group_id=p.group_id,
        packet_id=p.packet_id,
        close=close,
        expire_at_ms=p.expires_ms + core.settings.redis_grace_seconds * 1000,
    )
    try:
        closed = await run(core.batcher, core.scripts, call)
    except RedisError as e:
        raise unavailable(e) or Unavailable(errors.REDIS_UNAVAILABLE, str(e)) from e
    out = [
        CreditEntry(p.packet_id, user, r.seq, r.amount, r.grabbed_ms, p.group_id)
        for user, r in closed.grabs.items()
    ]
    return Seen(out, [dropped_credit(p, d) for d in closed.dropped], closed.present)


async def settle(core: Core, p: Packet, seen: Seen, older_than_ms: int | None = None) -> Settled:
    """Credit every grab in ``seen`` that the database has not (idempotent); record every refusal and
    every grab a repair dropped (``credit_refusals``). With ``older_than_ms``, only grabs made before it.

    Cancelled half-way: the credits already committed stand; running it again pays the rest once.
    """
    rows = await core.db.fetchall(
        f"SELECT user_id FROM grab_records WHERE packet_id = %s AND status = '{RecordStatus.CREDITED}'",
        (p.packet_id,),
    )
    paid = {int(r[0]) for r in rows}
    credited = refused = 0
    for c in seen.grabs:
        if c.user_id in paid or (older_than_ms is not None and c.grabbed_ms >= older_than_ms):
            continue
        outcome = await credit_or_record(core.db, c, "settle")
        match outcome:
            case "credited":
                credited += 1
            case "already":
                pass
            case "later":  # (nothing decided: never refund around it; the next run settles it)
                raise Unavailable(
                    errors.DATABASE_UNAVAILABLE, f"packet {p.packet_id}: a share's shard is away"
                )
            case Refusal():
                refused += 1
                log.error(
                    "packet %d: grab of user %d share %d refused: %s", p.packet_id, c.user_id, c.seq, outcome
                )
            case _:
                assert_never(outcome)
    if seen.dropped:
        await core.db.run(
            lambda tx: record_refusals(tx, [(c, Refusal.SHARE_CONFLICT) for c in seen.dropped], "repair"),
            idempotent=True,
        )
    return Settled(credited, refused)


# What a refund run can come to: refunded, finished (nothing was left), taken (another worker has it),
# not_due, waiting (nothing to pay back, but a share still on its way: its next run finishes it).
RefundOutcome = StepsOutcome | Literal["not_due"]
REFUND_OUTCOMES: tuple[RefundOutcome, ...] = ("refunded", "finished", "taken", "not_due", "waiting")


@dataclass(frozen=True)
class Refund:
    packet_id: int
    outcome: RefundOutcome
    amount: int = 0


async def refund_packet(core: Core, packet_id: PacketId, now: int | None = None) -> Refund:
    """Close an expired packet: pay every grab it had, give the sender back what nobody took, clean Redis.

    Two workers at once: the compare-and-set on the status lets one through. A worker that died after
    claiming leaves ``refunding``; running this again finishes the job (the refund's journal key is
    ``refund:<packet>``, so it is paid once). A grab made in the last moment before expiry is paid, not
    refunded: the packet is closed in Redis and its grabs read in one durable call, and every one settled,
    before the refund is computed. If Redis cannot be reached for that, this raises ``Unavailable`` and
    the packet stays ``refunding`` (its grabs answered as expired) until a later run gets through.
    """
    now = now_ms() if now is None else now

    async def claim(tx: Tx) -> int:
        return await tx.execute(
            f"UPDATE red_packets SET status = '{PacketStatus.REFUNDING}'"
            f" WHERE id = %s AND status = '{PacketStatus.ACTIVE}' AND expires_ms <= %s",
            (packet_id, now),
        )

    claimed = await core.db.run(claim, idempotent=True)
    p = await load_packet(core, packet_id)
    if p is None:
        return Refund(packet_id, "taken")
    if claimed == 0 and p.status is not PacketStatus.REFUNDING:
        return Refund(packet_id, "not_due" if p.status is PacketStatus.ACTIVE else "taken")
    # The packet's Redis state checked against the database first (rebuilt if its keys were lost, with
    # the credits still in the outbox), loaded closed; then closed and read durably: no grab after this.
    for _ in range(2):
        try:
            await recover_packet(core, packet_id)
        except RedPacketError as e:
            if e.code != errors.PACKET_EXPIRED:  # refunded meanwhile by another worker: the pay-back says so
                raise
        seen = await read_grabs(core, p, close=True)
        if seen.present:
            break
        # The keys went between the repair and the close (expired, evicted, lost): rebuild them again,
        # with the credits still in the outbox, before anything is paid back.
    else:
        raise Unavailable(errors.REDIS_UNAVAILABLE, f"packet {packet_id}'s state keeps vanishing from Redis")
    await settle(core, p, seen)

    async def pay_back(tx: Tx) -> Refund:
        row = await tx.fetchone(
            "SELECT sender_id, total, status, group_id, share_count FROM red_packets WHERE id = %s"
            + tx.dialect.for_update,
            (packet_id,),
        )
        if row is None:
            return Refund(packet_id, "taken")
        if row[2] != PacketStatus.REFUNDING:
            return await _settled_before(tx, packet_id, str(row[2]))
        sender, total, group = int(row[0]), int(row[1]), int(row[3])
        paid = await tx.fetchone(
            "SELECT COALESCE(SUM(amount), 0) FROM grab_records WHERE packet_id = %s AND status ="
            f" '{RecordStatus.CREDITED}'",
            (packet_id,),
        )
        left = total - int(paid[0] if paid else 0)
        if left < 0:
            raise RuntimeError(f"packet {packet_id} paid out more than its total")
        status = PacketStatus.REFUNDED if left else PacketStatus.FINISHED
        if left:
            await post_refund(tx, packet_id=packet_id, group_id=group, sender_id=sender, amount=left)
        else:
            await finished_event(tx, packet_id, sender, group, total, int(row[4]), now_ms())
        await tx.execute(
            "UPDATE red_packets SET status = %s, finished_ms = %s WHERE id = %s", (status, now, packet_id)
        )
        return Refund(packet_id, "refunded" if left else "finished", left)

    if core.db.shards:  # the pay-back as shard-local steps (server.money.shardsteps)
        steps = await shardsteps.refund(core.db, packet_id, now)
        result = Refund(packet_id, steps.outcome, steps.amount)
    else:
        result = await core.db.run(pay_back, idempotent=True)
    # Settled, by this worker or another: the keys go (a grab of it is then answered from the database).
    try:
        await core.redis.delete(*keys.packet_keys(group_id=p.group_id, packet_id=packet_id))
    except RedisError as e:
        log.warning("packet %d settled; its Redis keys stay until they expire (%s)", packet_id, e)
    if result.outcome == "waiting":
        log.warning("packet %d: nothing to pay back, a share still on its way: finished later", packet_id)
    elif result.outcome != "taken":
        log.info("packet %d %s, %d cents back to the sender", packet_id, result.outcome, result.amount)
    return result


async def _settled_before(tx: Tx, packet_id: PacketId, status: str) -> Refund:
    """The pay-back found the packet settled: by this very call, in a run whose COMMIT answer was lost
    (its refund row carries the call's token; only a refund finishes a ``refunding`` packet), or by
    another worker."""
    if tx.resumed and status == PacketStatus.FINISHED:
        return Refund(packet_id, "finished")
    if tx.resumed and status == PacketStatus.REFUNDED:
        row = await tx.fetchone(
            "SELECT amount, tx FROM journal WHERE idem_key = %s", (refund_key(packet_id),)
        )
        if row is not None and row[1] is not None and int(row[1]) == tx.token:
            return Refund(packet_id, "refunded", int(row[0]))
    return Refund(packet_id, "taken")


async def due_for_refund(core: Core, now: int | None = None, limit: int = 500) -> list[PacketId]:
    """Packets past their expiry not yet settled, and refunds a dead worker left half-way."""
    now = now_ms() if now is None else now
    rows = await core.db.fetchall(
        f"SELECT id FROM red_packets WHERE (status = '{PacketStatus.ACTIVE}' AND expires_ms <= %s) OR"
        f" status = '{PacketStatus.REFUNDING}'"
        # Newly due first: a refund waiting for its Redis (``refunding``) must not hold up the others.
        f" ORDER BY status = '{PacketStatus.REFUNDING}', expires_ms LIMIT %s",
        (now, limit),
    )
    return [PacketId(int(r[0])) for r in rows]


async def mark_finished(core: Core) -> int:
    """Active packets whose every share is credited become ``finished``; returns how many. (Crediting
    the last share does this already; this catches packets credited before it did, and those whose count
    of shares paid a process from before that count missed: set from their records, and said.)"""
    rows = await core.db.fetchall(
        f"SELECT id FROM red_packets WHERE status = '{PacketStatus.ACTIVE}' AND share_count = (SELECT"
        " COUNT(*)"
        f" FROM grab_records g WHERE g.packet_id = red_packets.id AND g.status = '{RecordStatus.CREDITED}')"
    )
    done = 0
    for ids in by_shard([int(r[0]) for r in rows], core.db.shards).values():  # (one shard a transaction)
        done += await core.db.run(
            functools.partial(_finish_full, ids=[PacketId(i) for i in ids]), idempotent=True
        )
    return done


async def _finish_full(tx: Tx, ids: list[PacketId]) -> int:
    await lock_packets(tx, ids)
    fixed = await recount_paid(tx, ids)
    if fixed:
        log.warning("packets %s: their count of shares paid was not their records'; set from them", fixed)
    return await finish_paid(tx, dict.fromkeys(ids, 0))  # (no record marked paid here: only look)


async def sweep(core: Core, now: int | None = None, window_ms: int = 26 * 3600 * 1000) -> Settled:
    """Credit grabs Redis recorded that the database never received and the drain did not pay within
    ``STRANDED_MS``, for every live packet of the window. A packet Redis cannot be read for is skipped
    (the next sweep looks again); a refund never is."""
    now = now_ms() if now is None else now
    credited = refused = 0
    if core.db.shards:  # what a shard-local money move left half-way
        credited += await shardsteps.complete_stranded(core.db, now - STRANDED_MS)
        voided = await shardsteps.void_unsent(core.db, now - shardsteps.UNSENT_MS, now - window_ms)
        if voided:
            log.warning("%d send(s) debited and never made: refunded to their senders", voided)
    rows = await core.db.fetchall(
        f"SELECT {PACKET_COLUMNS} FROM red_packets"
        f" WHERE status IN ('{PacketStatus.ACTIVE}', '{PacketStatus.REFUNDING}') AND created_ms >= %s",
        (now - window_ms,),
    )
    for p in map(packet_from_row, rows):
        try:
            seen = await read_grabs(core, p, close=False)
        except Unavailable as e:
            log.warning("packet %d: cannot read its grabs (%s); the next sweep looks again", p.packet_id, e)
            continue
        s = await settle(core, p, seen, older_than_ms=now - STRANDED_MS)
        credited += s.credited_now
        refused += s.refused
    return Settled(credited, refused)
