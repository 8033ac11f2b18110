"""Send and recover red packets: the packet's life in the database and its state in Redis.

Send debits the sender and writes the packet and its pre-split shares in one database transaction, then
publishes them to Redis. Recover rebuilds a packet's Redis state from the database (after a restart or a
failover, or by hand). Grabbing and opening a packet are ``server.money.grabs``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Protocol, TypeVar, cast

from redis.exceptions import RedisError

from redpacket_client.fairness import SEED_BYTES
from server import errors
from server.core import Core
from server.errors import Conflict, Forbidden, InvalidRequest, NotFound, Unavailable
from server.ids import GroupId, PacketId, ShareSeq, UserId
from server.money import groups, shardsteps
from server.money.creditrules import Refusal, record_refusals
from server.money.journal import post_event
from server.money.ledger import check_request_id, now_ms
from server.money.packetrows import (
    PACKET_COLUMNS,
    Packet,
    PacketKeyTaken,
    new_packet,
    packet_from_row,
    packet_rows,
    sent_data,
)
from server.money.split import PacketRequest, validate_request
from server.money.statuses import PacketStatus
from server.store import keys
from server.store.db import Database, Tx, as_text
from server.store.records import CreditEntry, DroppedEntry, GrabRecord, ShareEntry
from server.store.redisconn import ServerChanged
from server.store.scriptcalls import LoadPacketCall, run_alone

__all__ = ["PACKET_COLUMNS", "Packet", "load_packet", "packet_from_row", "recover_packet", "send_packet"]

log = logging.getLogger(__name__)


def new_request_id() -> str:
    """The idempotency key of a send whose client gave none: made before its transaction, so that a run
    again after a lost COMMIT answer finds the first run's packet instead of paying for a second one."""
    return uuid.uuid4().hex


async def _earlier_send(
    tx: Tx, req: PacketRequest, request_id: str, *, sender_id: UserId, group_id: GroupId
) -> Packet:
    row = await tx.fetchone(
        f"SELECT {PACKET_COLUMNS} FROM red_packets WHERE sender_id = %s AND request_id = %s",
        (sender_id, request_id),
    )
    if row is None:
        raise RuntimeError("a send replay found no earlier packet")
    p = packet_from_row(row)
    if tx.resumed:
        # This very call made it, in a run whose COMMIT answer was lost: not a replay, and it is still
        # to be put up in Redis.
        debit = await tx.fetchone("SELECT tx FROM journal WHERE idem_key = %s", (f"send:{p.packet_id}",))
        if debit is not None and debit[0] is not None and int(debit[0]) == tx.token:
            return p
    if (p.group_id, p.kind, p.total, p.count, p.greeting, p.target_user_id) != (
        group_id,
        req.kind,
        req.total,
        req.count,
        req.greeting,
        req.target_user_id,
    ):
        raise Conflict(errors.IDEMPOTENCY_KEY_REUSED, f"request id {request_id} was used for another packet")
    return dataclasses.replace(p, replay=True)


async def send_packet(
    core: Core,
    *,
    sender_id: UserId,
    group_id: GroupId,
    kind: object,
    total: object,
    count: object,
    greeting: object = "",
    target_user_id: object = None,
    request_id: str | None = None,
    system: bool = False,
    approve: SendApproval | None = None,
) -> Packet:
    """Debit the sender and create a packet with its shares; then publish it to Redis. ``system``: the
    chat backend sends from an account of its own that is no member of the group (a promotion): the
    group's rules of who sends are not asked, every other rule is. ``approve``: the chat backend's say
    (``server.hub.hooks``), asked once the request is known good and before any money moves; a greeting
    it changed is checked as any.

    Bad input raises ``InvalidRequest`` before anything is written. The debit, the packet, its shares
    and the journal row commit together or not at all. Every send is keyed before its transaction: by
    the client's ``request_id`` (a retried send returns the first packet instead of paying twice), or by
    one made here (``new_request_id``), so the database's own run again after a lost COMMIT answer pays
    once too. Redis must answer first (``redis_unavailable`` otherwise, and nothing is debited): a packet
    is sent only when it can be put up at once. Cancelled before the commit: nothing is written; after
    it: the packet exists, ``published`` or not, and ``server.live.announce`` (the sender's retry, or a
    worker) puts it up and announces it.
    """
    req = validate_request(kind, total, count, greeting, target_user_id, core.limits)
    key = new_request_id() if request_id is None else check_request_id(request_id)
    if approve is not None:
        changed = await approve(req, key, sender_id=sender_id, group_id=group_id)
        if changed is not None:
            req = validate_request(req.kind, req.total, req.count, changed, req.target_user_id, core.limits)
    # The shares are drawn from it once the packet has its id (redpacket_client.fairness); only its
    # commitment is shown until the packet is finished or refunded.
    seed = core.rng.randbytes(SEED_BYTES)
    await _require_redis(core, group_id)

    async def work(tx: Tx) -> Packet:
        await _may_send(tx, req, sender_id=sender_id, group_id=group_id, system=system)
        exists = await tx.fetchone(
            "SELECT 1 FROM red_packets WHERE sender_id = %s AND request_id = %s", (sender_id, key)
        )
        if not exists:
            try:
                return await _insert_packet(core, tx, req, key, seed, sender_id=sender_id, group_id=group_id)
            except PacketKeyTaken:
                # Its key committed meanwhile (read committed: seen now). In this same run, whose token
                # and ``resumed`` say whether it was this very call's earlier run — a slow COMMIT given up
                # on — or another call's.
                pass
        return await _earlier_send(tx, req, key, sender_id=sender_id, group_id=group_id)

    if core.db.shards:
        packet = await _send_sharded(
            core, req, key, seed, sender_id=sender_id, group_id=group_id, system=system
        )
    else:
        packet = await core.db.run(work, idempotent=True)
    if packet.replay:
        return packet
    try:
        generation = core.repairs.generation
        shares = packet.shares()  # this call's seed, or (made by its earlier run) the one it stored
        all_shares = [ShareEntry(ShareSeq(seq), amount) for seq, amount in enumerate(shares, start=1)]
        await _load(core, packet, all_shares, {})
        core.repairs.mark(packet.packet_id, generation)
    except RedisError as e:
        log.warning(
            "packet %d saved but not published to Redis (%s); recover_packet brings it up",
            packet.packet_id,
            e,
        )
        return dataclasses.replace(packet, published=False)
    return packet


class SendApproval(Protocol):
    """The chat backend's say on a send known good (``server.hub.hooks.Hooks.approve_send``): None, or
    the greeting it changed; it raises to refuse."""

    async def __call__(
        self, req: PacketRequest, request_id: str, *, sender_id: UserId, group_id: GroupId
    ) -> str | None: ...


async def greeting_sent_before(db: Database, sender_id: UserId, request_id: str) -> str | None:
    """The greeting of ``sender_id``'s packet sent with ``request_id`` (a retry: it answers that one,
    whose greeting the chat backend's hook may have changed), or None if there is none."""
    row = await db.fetchone(
        "SELECT greeting FROM red_packets WHERE sender_id = %s AND request_id = %s", (sender_id, request_id)
    )
    return None if row is None else as_text(row[0])


async def _may_send(
    tx: Tx, req: PacketRequest, *, sender_id: UserId, group_id: GroupId, system: bool = False
) -> None:
    """Refuse the send unless the sender may send here (any group for a ``system`` sender: the chat
    backend's own account), the group has enough members for the shares and the target (if any) is
    another member."""
    role, members_can_send = await groups.role_of(tx, group_id=group_id, user_id=sender_id)
    # (A system sender is asked nothing of the group: it exists, or role_of said not found.)
    if not system and role is None:
        raise Forbidden(errors.NOT_MEMBER, f"user {sender_id} is not a member of group {group_id}")
    if not system and role != "admin" and not members_can_send:
        raise Forbidden(errors.NOT_ADMIN, "only group admins send packets here")
    size = await tx.fetchone("SELECT COUNT(*) FROM group_members WHERE group_id = %s", (group_id,))
    if size is not None and req.count > int(size[0]):
        raise InvalidRequest(
            errors.COUNT_TOO_LARGE, f"more shares than the group's {size[0]} members", limit=int(size[0])
        )
    if req.target_user_id is not None:
        target = UserId(req.target_user_id)
        target_role, _ = await groups.role_of(tx, group_id=group_id, user_id=target)
        if target_role is None or target == sender_id:
            raise InvalidRequest(errors.TARGET_INVALID, "the target must be another member of the group")


async def _insert_packet(
    core: Core,
    tx: Tx,
    req: PacketRequest,
    key: str,
    seed: bytes,
    *,
    sender_id: UserId,
    group_id: GroupId,
) -> Packet:
    """The packet's row, its shares and the sender's debit, in the caller's transaction."""
    created = now_ms()
    expires = created + core.settings.packet_ttl_seconds * 1000
    packet_id = await packet_rows(tx, req, key, seed, sender_id, group_id, created, expires)
    data = sent_data(packet_id, req, sender_id, group_id, expires)
    await post_event(tx, sender_id, -req.total, "send", f"send:{packet_id}", "packet.sent", data, packet_id)
    return new_packet(packet_id, req, sender_id, group_id, created, expires, seed)


async def _send_sharded(
    core: Core,
    req: PacketRequest,
    key: str,
    seed: bytes,
    *,
    sender_id: UserId,
    group_id: GroupId,
    system: bool = False,
) -> Packet:
    """The send on a sharded ledger (``server.money.shardsteps``): the debit on the sender's shard, keyed
    by the request, then the packet, with the debit's id, on its own shard."""
    created = now_ms()
    expires = created + core.settings.packet_ttl_seconds * 1000
    debit = f"send:{sender_id}:{key}"
    packet_id = await shardsteps.debit_send(
        core.db,
        sender_id,
        debit,
        req.total,
        lambda tx: _may_send(tx, req, sender_id=sender_id, group_id=group_id, system=system),
        lambda pid: sent_data(PacketId(pid), req, sender_id, group_id, expires),
    )

    async def insert(tx: Tx) -> None:
        await packet_rows(tx, req, key, seed, sender_id, group_id, created, expires, packet_id)

    # Made by this call: a send now (also when its debit is an earlier call's that died before making
    # it), put up in Redis with the shares of this seed. Made by another call of the request: its
    # shares, a replay.
    if not await shardsteps.create_packet(core.db, packet_id, (sender_id, key, seed.hex()), insert):
        return await core.db.run(
            lambda tx: _earlier_send(tx, req, key, sender_id=sender_id, group_id=group_id), idempotent=True
        )
    return new_packet(packet_id, req, sender_id, group_id, created, expires, seed)


async def _require_redis(core: Core, group_id: GroupId) -> None:
    try:
        await core.batcher.call(lambda pipe: pipe.ping(), keys.group_members(group_id))
    except RedisError as e:
        raise Unavailable(errors.REDIS_UNAVAILABLE, f"Redis is unavailable, nothing was sent: {e}") from e


async def _load(
    core: Core,
    p: Packet,
    shares: list[ShareEntry],
    grabs: dict[UserId, GrabRecord],
    finished_ms: int | None = None,
) -> tuple[int, int, list[CreditEntry]]:
    """Run load_packet.lua: all shares and the grabs the database holds. Returns (shares left, grabs known,
    every grab a repair of this packet ever dropped)."""
    meta: dict[str, str | int] = {
        "group": p.group_id,
        "sender": p.sender_id,
        "kind": p.kind,
        "total": p.total,
        "count": p.count,
        "greeting": p.greeting,
        "target": "" if p.target_user_id is None else p.target_user_id,
        "created_ms": p.created_ms,
        "expires_ms": p.expires_ms,
    }
    if p.seed is not None:
        meta["seed"] = p.seed.hex()  # shown by a view once the packet is finished or closed (never before)
    if finished_ms is not None:
        meta["finished_ms"] = finished_ms
    if p.status is PacketStatus.REFUNDING:
        meta["closed"] = 1  # its refund has begun: no grab may start again, whatever Redis lost
    meta_key = keys.packet_meta(group_id=p.group_id, packet_id=p.packet_id)
    call = LoadPacketCall(
        group_id=p.group_id,
        packet_id=p.packet_id,
        expire_at_ms=p.expires_ms + core.settings.redis_grace_seconds * 1000,
        meta=dict(meta),
        shares=shares,
        grabs=grabs,
        stamp=core.repairs.stamp(meta_key),
    )
    loaded = await run_alone(core.scripts, call)
    return loaded.shares_left, loaded.grabs_known, [dropped_credit(p, d) for d in loaded.dropped]


def dropped_credit(p: Packet, d: DroppedEntry) -> CreditEntry:
    """The credit of a grab a repair dropped (a ``keys.packet_dropped`` entry)."""
    r = d.record
    return CreditEntry(p.packet_id, d.user_id, r.seq, r.amount, r.grabbed_ms, p.group_id)


@dataclass(frozen=True)
class Recovered:
    packet_id: int
    shares_left: int
    grabs_known: int


async def load_packet(core: Core, packet_id: PacketId) -> Packet | None:
    """A packet as the database has it, or None."""
    row = await core.db.fetchone(f"SELECT {PACKET_COLUMNS} FROM red_packets WHERE id = %s", (packet_id,))
    return None if row is None else packet_from_row(row)


async def recover_packet(core: Core, packet_id: PacketId) -> Recovered:
    """Rebuild a packet's Redis state from the database: shares not yet taken, grabs already made.

    Safe while grabs continue and safe to repeat: the script runs alone, keeps every grab Redis already
    holds unless the database holds that share (or that user) otherwise — then the database's grab
    replaces it, and the dropped one is recorded as refused (its grabber may have been told "won") —
    and never puts back a share that Redis, its outbox or the database shows as taken. This is also the
    check of a packet after Redis may have lost writes (``server.store.repair``).

    Serialised with crediting: it holds the packet's row lock (as every credit takes it first) from
    before it reads until Redis is loaded, so no credit of this packet commits in between, and it reads
    the outbox before the database, so a credit paid and acknowledged meanwhile is in one of them.
    Cancelled half-way: Redis is loaded or not (one script); running it again does the rest.
    """

    async def work(tx: Tx) -> tuple[Packet, int, int, list[CreditEntry]]:
        p = await _locked(tx, packet_id)
        if p.status in (PacketStatus.REFUNDED, PacketStatus.VOID):  # (void: a send never made: shardsteps)
            raise Conflict(errors.PACKET_EXPIRED, f"packet {packet_id} was refunded")
        generation = core.repairs.generation
        rows = await tx.fetchall(
            "SELECT seq, amount FROM red_packet_shares WHERE packet_id = %s ORDER BY seq", (packet_id,)
        )
        shares = [ShareEntry(ShareSeq(int(x[0])), int(x[1])) for x in rows]
        taken = await _taken(core, tx, p)
        finished = max(g.grabbed_ms for g in taken.values()) if len(taken) == p.count else None
        left, n, dropped = await _bounded(_load(core, p, shares, taken, finished))
        core.repairs.mark(packet_id, generation)
        return p, left, n, dropped

    try:
        p, left, known, dropped = await core.db.run(work, idempotent=True)
    except ServerChanged:
        raise  # the caller checks again in the new generation
    except RedisError as e:
        raise Unavailable(errors.REDIS_UNAVAILABLE, str(e)) from e
    if dropped:
        # Kept in Redis too (keys.packet_dropped) until the packet's keys go: a failure here loses nothing.
        await core.db.run(
            lambda tx: record_refusals(tx, [(c, Refusal.SHARE_CONFLICT) for c in dropped], "repair"),
            idempotent=True,
        )
        log.error(
            "packet %d: %d grab(s) Redis held contradict the database; dropped and recorded as refused",
            packet_id,
            len(dropped),
        )
    log.info("recovered packet %d: %d shares left, %d grabs known", packet_id, left, known)
    return Recovered(p.packet_id, left, known)


# A repair holds its packet's row lock (and, on SQLite, the one writer's) while it talks to Redis: a Redis
# that stops answering without closing the connection must not hold it longer than this.
REPAIR_REDIS_SECONDS = 5.0

T = TypeVar("T")


async def _bounded(aw: Awaitable[T]) -> T:
    """``aw``, or ``Unavailable`` after ``REPAIR_REDIS_SECONDS``: the transaction then rolls back and the
    lock goes (the load script, if it ran, is safe to run again)."""
    try:
        return await asyncio.wait_for(aw, REPAIR_REDIS_SECONDS)
    except TimeoutError:
        raise Unavailable(errors.REDIS_UNAVAILABLE, "Redis did not answer the repair in time") from None


async def _locked(tx: Tx, packet_id: PacketId) -> Packet:
    """The packet's row, locked until ``tx`` ends: every credit of it takes this lock first."""
    row = await tx.fetchone(
        f"SELECT {PACKET_COLUMNS} FROM red_packets WHERE id = %s" + tx.dialect.for_update, (packet_id,)
    )
    if row is None:
        raise NotFound(errors.PACKET_NOT_FOUND, f"packet {packet_id} does not exist")
    return packet_from_row(row)


async def _taken(core: Core, tx: Tx, p: Packet) -> dict[UserId, GrabRecord]:
    """The grabs a repair must keep, by grabber: the database's, and — when the
    packet's keys are gone — those whose credit still waits in the outbox. The outbox is read first: a
    credit acknowledged since was committed before, so the database read after it has it."""
    # A meta hash that names its group is the packet's keys being there (a close alone makes one without).
    meta = keys.packet_meta(group_id=p.group_id, packet_id=p.packet_id)
    present = await _bounded(cast(Awaitable[bool], core.redis.hexists(meta, "group")))
    queued = [] if present else await _bounded(_queued(core, p))
    rows = await tx.fetchall(
        "SELECT user_id, seq, amount, grabbed_ms FROM grab_records WHERE packet_id = %s", (p.packet_id,)
    )
    known = {UserId(int(g[0])): GrabRecord(ShareSeq(int(g[1])), int(g[2]), int(g[3])) for g in rows}
    seqs = {g.seq for g in known.values()}
    for c in queued:
        if c.user_id not in known and c.seq not in seqs:
            known[c.user_id] = c.record
    return known


async def _queued(core: Core, p: Packet) -> list[CreditEntry]:
    """Credits of this packet waiting in the shard's outbox (or being paid), one per share: told to their
    grabber, perhaps not yet in the database.

    When only the packet's keys were lost (not the whole Redis), these keep their share instead of it
    being handed out a second time. A read of the outbox: recovery is rare and the outbox short.
    """
    prefix = f"{p.packet_id}:".encode()
    found: dict[ShareSeq, CreditEntry] = {}
    for _, fields in await core.redis.xrange(keys.outbox_for(p.group_id)):
        entry = fields.get(b"c", b"")
        if entry.startswith(prefix):
            c = CreditEntry.parse(entry)
            found.setdefault(c.seq, c)
    return list(found.values())
