"""Grab and open red packets: taking a share (one Lua call in the group's slot) and seeing who took which.

Grab pops a share, remembers who took it and writes its credit to the slot's outbox, all in one call;
after a Redis restart or failover the packet is first recovered from the database
(``server.money.packets.recover_packet``). Open is one Redis round trip, or the database once the
packet's keys are gone. The pure pieces (the view of a packet) are plain functions at the bottom.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Literal

from redis.exceptions import RedisError

from redpacket_client.fairness import commitment
from server import errors, tracing
from server.core import Core, unavailable
from server.errors import Conflict, Forbidden, NotFound, RedPacketError, Unavailable
from server.ids import GroupId, PacketId, ShareSeq, UserId
from server.money import queries
from server.money.membership import not_member
from server.money.packets import PACKET_COLUMNS, packet_from_row, recover_packet
from server.money.statuses import PacketStatus
from server.store import keys
from server.store.records import GrabRecord
from server.store.redisconn import ServerChanged
from server.store.scriptcalls import GrabCall, GrabRate, GrabReply, GrabStatus, run

log = logging.getLogger(__name__)

REDIS = {"db.system": "redis", "db.operation": "EVALSHA"}  # a Redis call's span attributes


@dataclass(frozen=True)
class Grab:
    user_id: UserId
    seq: ShareSeq
    amount: int
    grabbed_ms: int

    @classmethod
    def of(cls, user_id: UserId, record: GrabRecord) -> Grab:
        return cls(user_id, record.seq, record.amount, record.grabbed_ms)


@dataclass(frozen=True)
class GrabResult:
    outcome: Literal["won", "already"]
    packet_id: PacketId
    grab: Grab
    remaining: int


def refusal_error(code: str) -> RedPacketError:
    """The error a grab answers with for ``code`` (``packet_empty``, ``packet_expired``, ``not_target``;
    anything else: ``packet_not_found``), whether Redis or the hub (``server.hub.packetcache``) decided it."""
    if code == errors.PACKET_EMPTY:
        return Conflict(code, "every share has been grabbed")
    if code == errors.PACKET_EXPIRED:
        return Conflict(code, "the packet has expired")
    if code == errors.NOT_TARGET:
        return Forbidden(code, "this packet is for someone else")
    return NotFound(errors.PACKET_NOT_FOUND, "no such packet in this group")


# The grab script's refusals (``lua/grab.lua``) and the error code of each.
_REFUSALS = {"empty": errors.PACKET_EMPTY, "expired": errors.PACKET_EXPIRED, "not_target": errors.NOT_TARGET}


def _refusal(status: str) -> RedPacketError:
    """The error for a grab script answer other than won / already."""
    return refusal_error(_REFUSALS.get(status, errors.PACKET_NOT_FOUND))


async def grab(
    core: Core, *, packet_id: PacketId, group_id: GroupId, user_id: UserId, gate: bool = False
) -> GrabResult:
    """Take one share of a packet for ``user_id``, or the share they took before.

    One Lua call, one round trip, on the group's shard: the member check (Redis cache of the database),
    the block and rate limit when ``gate`` (the hub's), the share, and its credit record in the shard's
    outbox. A share is never taken without its credit recorded in the same atomic call. A second grab by
    the same user returns the same share. With durable grabs the answer waits until the grab is on disk
    or on a replica (``server.store.batch``). A cold member cache costs one database read and a second call;
    so does a live packet that Redis no longer knows, recovered from the database first; so does the
    first grab of a packet after Redis restarted or failed over (``server.store.repair``).
    """

    async def attempt(check_members: bool, gate: bool) -> GrabReply:
        call = grab_call(
            core,
            packet_id=packet_id,
            group_id=group_id,
            user_id=user_id,
            check_members=check_members,
            gate=gate,
        )
        if tracing.ON and tracing.recording():  # a grab traced: its credit record carries this span
            with tracing.span("redis grab.lua", "client", packet_id=packet_id, user_id=user_id, **REDIS):
                call.trace = tracing.traceparent()
                return await run(core.batcher, core.scripts, call)
        return await run(core.batcher, core.scripts, call)

    meta_key = keys.packet_meta(group_id=group_id, packet_id=packet_id)
    try:
        first: GrabReply | None = None
        for _ in range(3):
            generation = core.repairs.generation
            try:
                await core.repairs.ensure(
                    packet_id, lambda: _check(core, packet_id), (meta_key, lambda: _stamp(core, meta_key))
                )
                reply = await attempt(True, gate)
                if reply.status == "members":
                    # The cache was cold and the script stopped before the gate: it still applies.
                    await core.membership.require(group_id=group_id, user_id=user_id)
                    reply = await attempt(False, gate)
                if reply.status == "unknown" and await _recover_if_live(
                    core, packet_id=packet_id, group_id=group_id
                ):
                    # This attempt passed the member check and the gate already: not charged twice.
                    reply = await attempt(False, False)
            except ServerChanged:
                continue  # seen before the grab was sent: check the packet in the new generation first
            if reply.status == "already" and first is not None and first.status == "won":
                if first.record == reply.record:
                    reply = first  # it was this grab that won that share: say so (it is announced)
            if core.repairs.generation == generation:
                break
            # A Redis server restarted or failed over while this grab was in flight: check the packet
            # against the database, then ask again before answering (the same user gets the same share,
            # unless the database showed it to be someone else's).
            first = first or reply
        else:
            raise Unavailable(errors.REDIS_UNAVAILABLE, "Redis keeps changing under this grab: retry")
    except RedisError as e:
        down = unavailable(e)
        if down is None:
            raise  # not Redis being away: a bug, answered internal and logged by the caller
        raise down from e
    return _answer(reply, packet_id=packet_id, group_id=group_id, user_id=user_id)


def _answer(reply: GrabReply, *, packet_id: PacketId, group_id: GroupId, user_id: UserId) -> GrabResult:
    """The grab's result for the script's reply, or its error."""
    status: GrabStatus = reply.status
    if status == "not_member":
        raise not_member(group_id=group_id, user_id=user_id)
    if status == "blocked":
        raise Forbidden(errors.BLOCKED, "grabbing is blocked for this account for now")
    if status == "limited":
        raise Conflict(errors.RATE_LIMITED, f"too many grabs: try again in {reply.wait_ms} ms")
    if (status == "won" or status == "already") and reply.record is not None and reply.remaining is not None:
        return GrabResult(status, packet_id, Grab.of(user_id, reply.record), reply.remaining)
    raise _refusal(status)


async def _stamp(core: Core, meta_key: str) -> str | None:
    """The packet's stamp (``server.store.repair``), read in this tick's pipeline to its master."""
    raw = await core.batcher.call(lambda pipe: pipe.hget(meta_key, keys.PACKET_STAMP), meta_key)
    return None if raw is None else raw.decode() if isinstance(raw, bytes) else str(raw)


async def _check(core: Core, packet_id: PacketId) -> None:
    """The check of a packet after Redis may have lost writes: ``recover_packet``, for a packet the
    database has and still pays out (one it refunded, or never had, is answered by the grab itself)."""
    try:
        await recover_packet(core, packet_id)
    except (NotFound, Conflict):
        pass


def grab_call(
    core: Core, *, packet_id: PacketId, group_id: GroupId, user_id: UserId, check_members: bool, gate: bool
) -> GrabCall:
    """One call of ``lua/grab.lua`` with this core's settings (``gate``: the hub's block list and rate)."""
    s = core.settings
    return GrabCall(
        user_id=user_id,
        group_id=group_id,
        packet_id=packet_id,
        check_members=check_members,
        rate=GrabRate(s.grabs_per_second, s.grabs_burst) if gate else None,
        rewrite_repeat=s.durability.waits,
    )


async def _recover_if_live(core: Core, *, packet_id: PacketId, group_id: GroupId) -> bool:
    found = await queries.packet_status(core.db, packet_id)
    if found is None or found[0] != group_id or found[1] == PacketStatus.REFUNDED:
        return False
    await recover_packet(core, packet_id)
    return True


@dataclass(frozen=True)
class PacketView:
    """What ``open`` shows: the packet, this user's share and the grab list in grab order."""

    packet_id: PacketId
    group_id: GroupId
    sender_id: UserId
    kind: str
    total: int
    count: int
    greeting: str
    created_ms: int
    expires_ms: int
    remaining: int
    grabs: list[Grab]
    mine: Grab | None
    finished_ms: int | None
    best_luck: Grab | None
    # The packet's proof (``redpacket_client.fairness``): the commitment from the send on (None: sent before
    # packets were provably fair), the seed only once the packet is finished or closed for its refund.
    commitment: str | None = None
    seed: str | None = None

    @property
    def duration_ms(self) -> int | None:
        """How long the packet took to empty; None until every share is grabbed (a refunded packet has a
        ``finished_ms``, the refund's time, and never emptied)."""
        if self.finished_ms is None or len(self.grabs) < self.count:
            return None
        return self.finished_ms - self.created_ms


def view_packet(
    meta: dict[str, str],
    records: dict[UserId, Grab],
    remaining: int,
    *,
    packet_id: PacketId,
    user_id: UserId | None,
) -> PacketView:
    """Build the view from a packet's meta fields and grabs. Pure."""
    grabs = sorted(records.values(), key=lambda g: (g.grabbed_ms, g.seq))
    count = int(meta["count"])
    finished = meta.get("finished_ms") or None
    finished_ms = int(finished) if finished else None
    if finished_ms is None and len(grabs) == count:
        finished_ms = grabs[-1].grabbed_ms
    # Best luck is only named once every share is out (not when a refund ended the packet); ties go to
    # whoever grabbed first.
    best = max(grabs, key=lambda g: (g.amount, -g.grabbed_ms, -g.seq)) if len(grabs) == count else None
    seed = meta.get("seed") or None
    # No grab can take a share of it any more: every share went, or its refund closed it.
    over = len(grabs) == count or meta.get("closed") == "1"
    return PacketView(
        packet_id=packet_id,
        group_id=GroupId(int(meta["group"])),
        sender_id=UserId(int(meta["sender"])),
        kind=meta["kind"],
        total=int(meta["total"]),
        count=count,
        greeting=meta.get("greeting", ""),
        created_ms=int(meta["created_ms"]),
        expires_ms=int(meta["expires_ms"]),
        remaining=remaining,
        grabs=grabs,
        mine=None if user_id is None else records.get(user_id),
        finished_ms=finished_ms,
        best_luck=best,
        commitment=None if seed is None else commitment(bytes.fromhex(seed)),
        seed=seed if over else None,
    )


def _text(d: dict[Any, Any]) -> dict[str, str]:
    return {
        (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
        for k, v in d.items()
    }


async def open_packet(
    core: Core, *, packet_id: PacketId, group_id: GroupId, user_id: UserId | None
) -> PacketView:
    """This user's result and the packet's grab list: one Redis round trip when the cache is warm.

    A read: calling it any number of times changes nothing. A packet whose Redis keys are gone (after its
    refund, or a Redis loss) is read from the database instead. ``user_id`` None: an operator's read
    (``redpacket verify``), of no member, with no ``mine``.
    """
    meta_key, shares_key, grabs_key, _ = keys.packet_keys(group_id=group_id, packet_id=packet_id)
    members_key = keys.group_members(group_id)
    b = core.batcher
    try:
        # Four reads of one slot, sent in this tick's pipeline to its master.
        meta_raw, grabs_raw, left, (loaded, member) = await asyncio.gather(
            b.call(lambda pipe: pipe.hgetall(meta_key), meta_key),
            b.call(lambda pipe: pipe.hgetall(grabs_key), grabs_key),
            b.call(lambda pipe: pipe.llen(shares_key), shares_key),
            b.call(lambda pipe: pipe.smismember(members_key, [keys.LOADED, str(user_id)]), members_key),
        )
        if not loaded and user_id is not None:
            member = await core.membership.is_member(group_id=group_id, user_id=user_id)
    except RedisError as e:
        raise Unavailable(errors.REDIS_UNAVAILABLE, str(e)) from e
    if not member and user_id is not None:
        raise not_member(group_id=group_id, user_id=user_id)
    meta = _text(meta_raw)
    if meta and meta.get("group") == str(group_id):
        records = {}
        for u, r in _text(grabs_raw).items():
            records[UserId(int(u))] = Grab.of(UserId(int(u)), GrabRecord.parse(r))
        return view_packet(meta, records, int(left), packet_id=packet_id, user_id=user_id)
    if meta:
        raise _refusal("unknown")
    return await _open_from_database(core, packet_id=packet_id, group_id=group_id, user_id=user_id)


async def _open_from_database(
    core: Core, *, packet_id: PacketId, group_id: GroupId, user_id: UserId | None
) -> PacketView:
    row = await core.db.fetchone(f"SELECT {PACKET_COLUMNS} FROM red_packets WHERE id = %s", (packet_id,))
    p = None if row is None else packet_from_row(row)
    if p is None or p.group_id != group_id:
        raise NotFound(errors.PACKET_NOT_FOUND, "no such packet in this group")
    rows = await core.db.fetchall(
        "SELECT user_id, seq, amount, grabbed_ms FROM grab_records WHERE packet_id = %s", (packet_id,)
    )
    records = {}
    for r in rows:
        user = UserId(int(r[0]))
        records[user] = Grab(user, ShareSeq(int(r[1])), int(r[2]), int(r[3]))
    meta = {
        "group": str(p.group_id),
        "sender": str(p.sender_id),
        "kind": p.kind,
        "total": str(p.total),
        "count": str(p.count),
        "greeting": p.greeting,
        "created_ms": str(p.created_ms),
        "expires_ms": str(p.expires_ms),
        "finished_ms": "" if p.finished_ms is None else str(p.finished_ms),
        "closed": "1" if p.status in (PacketStatus.REFUNDING, PacketStatus.REFUNDED) else "",
        "seed": "" if p.seed is None else p.seed.hex(),
    }
    return view_packet(meta, records, p.count - len(records), packet_id=packet_id, user_id=user_id)


def grab_dict(g: Grab) -> dict[str, object]:
    """A grab as the protocol sends it."""
    return {"user_id": g.user_id, "seq": g.seq, "amount": g.amount, "grabbed_ms": g.grabbed_ms}


def _grab_dict(g: Grab | None) -> dict[str, object] | None:
    return None if g is None else grab_dict(g)


def view_dict(v: PacketView) -> dict[str, Any]:
    """The packet view as the protocol sends it. Written out field by field: ``dataclasses.asdict``
    (recursive, copying) cost a loaded hub an eighth of its CPU, every member opening a 100-grab packet."""
    return {
        "packet_id": v.packet_id,
        "group_id": v.group_id,
        "sender_id": v.sender_id,
        "kind": v.kind,
        "total": v.total,
        "count": v.count,
        "greeting": v.greeting,
        "created_ms": v.created_ms,
        "expires_ms": v.expires_ms,
        "remaining": v.remaining,
        "grabs": [grab_dict(g) for g in v.grabs],
        "mine": _grab_dict(v.mine),
        "finished_ms": v.finished_ms,
        "best_luck": _grab_dict(v.best_luck),
        "duration_ms": v.duration_ms,
        "commitment": v.commitment,
        "seed": v.seed,
    }
