"""Send, grab, open and recover red packets: the money core's operations.

Send debits the sender and writes the packet and its pre-split shares in one database transaction, then
publishes them to Redis. Grab is one Lua call. Open is one Redis round trip. Recover rebuilds a packet's
Redis state from the database. The pure pieces (the view of a packet) are plain functions at the bottom.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Literal

from redis.commands.core import AsyncScript
from redis.exceptions import RedisError

from server import errors
from server.core import Core, unavailable
from server.errors import Conflict, Forbidden, InvalidRequest, NotFound, RedPacketError, Unavailable
from server.money import groups
from server.money.ledger import now_ms, post
from server.money.membership import not_member
from server.money.split import Kind, PacketRequest, split, validate_request
from server.store import keys
from server.store.db import IntegrityError, Row, Tx

log = logging.getLogger(__name__)

_PACKET_COLUMNS = (
    "id, sender_id, group_id, kind, total, share_count, greeting, target_user_id, status, request_id,"
    " created_ms, expires_ms, finished_ms, announced_ms"
)


@dataclass(frozen=True)
class Packet:
    packet_id: int
    sender_id: int
    group_id: int
    kind: Kind
    total: int
    count: int
    greeting: str
    target_user_id: int | None
    status: str
    created_ms: int
    expires_ms: int
    # False when Redis could not be reached at send: the money is safe in the database and
    # ``recover_packet`` (or the first grab) brings the packet up.
    published: bool = True
    # True when ``request_id`` matched an earlier send: nothing new was debited.
    replay: bool = False
    # When its event was published to the group (``server.hub.announce``); None until then.
    announced_ms: int | None = None


def _packet_from_row(row: Row) -> Packet:
    return Packet(
        packet_id=int(row[0]),
        sender_id=int(row[1]),
        group_id=int(row[2]),
        kind=row[3],
        total=int(row[4]),
        count=int(row[5]),
        greeting=str(row[6]),
        target_user_id=None if row[7] is None else int(row[7]),
        status=str(row[8]),
        created_ms=int(row[10]),
        expires_ms=int(row[11]),
        announced_ms=None if row[13] is None else int(row[13]),
    )


class _Replay(Exception):
    pass


async def _earlier_send(tx: Tx, sender_id: int, request_id: str, req: PacketRequest, group_id: int) -> Packet:
    row = await tx.fetchone(
        f"SELECT {_PACKET_COLUMNS} FROM red_packets WHERE sender_id = %s AND request_id = %s",
        (sender_id, request_id),
    )
    if row is None:
        raise RuntimeError("a send replay found no earlier packet")
    p = _packet_from_row(row)
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
    sender_id: int,
    group_id: int,
    kind: object,
    total: object,
    count: object,
    greeting: object = "",
    target_user_id: object = None,
    request_id: str | None = None,
) -> Packet:
    """Debit the sender and create a packet with its shares; then publish it to Redis.

    Bad input raises ``InvalidRequest`` before anything is written. The debit, the packet, its shares
    and the journal row commit together or not at all. With ``request_id`` a retried send returns the
    first packet instead of paying twice. Redis must answer first (``redis_unavailable`` otherwise, and
    nothing is debited): a packet is sent only when it can be put up at once. Cancelled before the
    commit: nothing is written; after it: the packet exists, ``published`` or not, and
    ``server.hub.announce`` (the sender's retry, or a worker) puts it up and announces it.
    """
    req = validate_request(kind, total, count, greeting, target_user_id, core.limits)
    if request_id is not None and (not isinstance(request_id, str) or not 0 < len(request_id) <= 64):
        raise InvalidRequest(errors.BAD_REQUEST, "request_id is 1 to 64 characters")
    shares = split(req, core.rng)
    await _require_redis(core, group_id)

    async def work(tx: Tx) -> Packet:
        role, members_can_send = await groups.role_of(tx, group_id, sender_id)
        if role is None:
            raise Forbidden(errors.NOT_MEMBER, f"user {sender_id} is not a member of group {group_id}")
        if role != "admin" and not members_can_send:
            raise Forbidden(errors.NOT_ADMIN, "only group admins send packets here")
        size = await tx.fetchone("SELECT COUNT(*) FROM group_members WHERE group_id = %s", (group_id,))
        if size is not None and req.count > int(size[0]):
            raise InvalidRequest(
                errors.COUNT_TOO_LARGE, f"more shares than the group's {size[0]} members", limit=int(size[0])
            )
        if req.target_user_id is not None:
            target_role, _ = await groups.role_of(tx, group_id, req.target_user_id)
            if target_role is None or req.target_user_id == sender_id:
                raise InvalidRequest(errors.TARGET_INVALID, "the target must be another member of the group")
        if request_id is not None:
            exists = await tx.fetchone(
                "SELECT 1 FROM red_packets WHERE sender_id = %s AND request_id = %s", (sender_id, request_id)
            )
            if exists:
                return await _earlier_send(tx, sender_id, request_id, req, group_id)
        created = now_ms()
        expires = created + core.settings.packet_ttl_seconds * 1000
        try:
            await tx.execute(
                "INSERT INTO red_packets (sender_id, group_id, kind, total, share_count, greeting,"
                " target_user_id, status, request_id, created_ms, expires_ms)"
                " VALUES (%s, %s, %s, %s, %s, %s, %s, 'active', %s, %s, %s)",
                (
                    sender_id,
                    group_id,
                    req.kind,
                    req.total,
                    req.count,
                    req.greeting,
                    req.target_user_id,
                    request_id,
                    created,
                    expires,
                ),
            )
        except IntegrityError:
            raise _Replay from None  # the same request id committed meanwhile
        packet_id = tx.lastrowid
        if packet_id is None:
            raise RuntimeError("the database returned no id for the new packet")
        await tx.executemany(
            "INSERT INTO red_packet_shares (packet_id, seq, amount) VALUES (%s, %s, %s)",
            [(packet_id, seq, amount) for seq, amount in enumerate(shares, start=1)],
        )
        await post(tx, sender_id, -req.total, "send", f"send:{packet_id}", packet_id)
        return Packet(
            packet_id,
            sender_id,
            group_id,
            req.kind,
            req.total,
            req.count,
            req.greeting,
            req.target_user_id,
            "active",
            created,
            expires,
        )

    try:
        packet = await core.db.run(work)
    except _Replay:
        assert request_id is not None
        packet = await core.db.run(lambda tx: _earlier_send(tx, sender_id, request_id, req, group_id))
    if packet.replay:
        return packet
    try:
        generation = core.repairs.generation
        await _load(core, packet, list(enumerate(shares, start=1)), [])
        core.repairs.mark(packet.packet_id, generation)
    except RedisError as e:
        log.warning(
            "packet %d saved but not published to Redis (%s); recover_packet brings it up",
            packet.packet_id,
            e,
        )
        return dataclasses.replace(packet, published=False)
    return packet


async def _require_redis(core: Core, group_id: int) -> None:
    try:
        await core.batcher.call(lambda pipe: pipe.ping(), keys.group_members(group_id))
    except RedisError as e:
        raise Unavailable(errors.REDIS_UNAVAILABLE, f"Redis is unavailable, nothing was sent: {e}") from e


async def _load(
    core: Core,
    p: Packet,
    shares: list[tuple[int, int]],
    grabs: list[tuple[int, int, int, int]],
    finished_ms: int | None = None,
) -> tuple[int, int, int]:
    """Run load_packet.lua: all shares (seq, amount) and the grabs (user, seq, amount, ms) the DB holds.
    Returns (shares left, grabs known, grabs Redis held that the database contradicts, dropped)."""
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
    if finished_ms is not None:
        meta["finished_ms"] = finished_ms
    args: list[str | int] = [p.expires_ms + core.settings.redis_grace_seconds * 1000, p.packet_id, len(meta)]
    for k, v in meta.items():
        args += [k, v]
    args.append(len(shares))
    args += [f"{seq}:{amount}" for seq, amount in shares]
    args.append(len(grabs))
    for user, seq, amount, ms in grabs:
        args += [user, f"{seq}:{amount}:{ms}"]
    keys_ = [*keys.packet_keys(p.group_id, p.packet_id), keys.outbox_for(p.group_id)]
    left, known, dropped = await core.scripts.load_packet(keys=keys_, args=args)
    return int(left), int(known), int(dropped)


@dataclass(frozen=True)
class Recovered:
    packet_id: int
    shares_left: int
    grabs_known: int


async def load_packet(core: Core, packet_id: int) -> Packet | None:
    """A packet as the database has it, or None."""
    row = await core.db.fetchone(f"SELECT {_PACKET_COLUMNS} FROM red_packets WHERE id = %s", (packet_id,))
    return None if row is None else _packet_from_row(row)


async def recover_packet(core: Core, packet_id: int) -> Recovered:
    """Rebuild a packet's Redis state from the database: shares not yet taken, grabs already made.

    Safe while grabs continue and safe to repeat: the script runs alone, keeps every grab Redis already
    holds unless the database holds that share (or that user) otherwise — then the database's grab
    replaces it — and never puts back a share that Redis or the database shows as taken. This is also
    the check of a packet after Redis may have lost writes (``server.store.repair``).
    """
    p = await load_packet(core, packet_id)
    if p is None:
        raise NotFound(errors.PACKET_NOT_FOUND, f"packet {packet_id} does not exist")
    if p.status == "refunded":
        raise Conflict(errors.PACKET_EXPIRED, f"packet {packet_id} was refunded")
    shares = await core.db.fetchall(
        "SELECT seq, amount FROM red_packet_shares WHERE packet_id = %s ORDER BY seq", (packet_id,)
    )
    grabs = await core.db.fetchall(
        "SELECT user_id, seq, amount, grabbed_ms FROM grab_records WHERE packet_id = %s", (packet_id,)
    )
    known_grabs = [(int(g[0]), int(g[1]), int(g[2]), int(g[3])) for g in grabs]
    finished = max(g[3] for g in known_grabs) if len(known_grabs) == p.count else None
    try:
        generation = core.repairs.generation
        if not await core.redis.exists(keys.packet_meta(p.group_id, p.packet_id)):
            # The packet's keys are gone: its credits still waiting in the outbox keep their shares.
            known_grabs += await _queued_credits(core, p, known_grabs)
        left, known, dropped = await _load(
            core, p, [(int(s[0]), int(s[1])) for s in shares], known_grabs, finished
        )
        core.repairs.mark(packet_id, generation)
    except RedisError as e:
        raise Unavailable(errors.REDIS_UNAVAILABLE, str(e)) from e
    if dropped:
        log.warning(
            "packet %d: %d grab(s) Redis held contradicted the database and were dropped", packet_id, dropped
        )
    log.info("recovered packet %d: %d shares left, %d grabs known", packet_id, left, known)
    return Recovered(packet_id, left, known)


async def _queued_credits(
    core: Core, p: Packet, paid: list[tuple[int, int, int, int]]
) -> list[tuple[int, int, int, int]]:
    """Grabs whose credit still waits in the shard's outbox (or is being paid): told to their grabber, not
    yet in the database, as (user, seq, amount, grabbed_ms) — those the database does not contradict.

    When only the packet's keys were lost (not the whole Redis), these keep their share instead of it
    being handed out a second time. A read of the outbox: recovery is rare and the outbox short.
    """
    users, seqs = {g[0] for g in paid}, {g[1] for g in paid}
    prefix = f"{p.packet_id}:".encode()
    found: dict[int, tuple[int, int, int, int]] = {}
    for _, fields in await core.redis.xrange(keys.outbox_for(p.group_id)):
        entry = fields.get(b"c", b"")
        if entry.startswith(prefix):
            _, user, seq, amount, ms, _ = keys.parse_credit_entry(entry)
            if user not in users and seq not in seqs:
                found[seq] = (user, seq, amount, ms)
    return list(found.values())


@dataclass(frozen=True)
class Grab:
    user_id: int
    seq: int
    amount: int
    grabbed_ms: int


@dataclass(frozen=True)
class GrabResult:
    outcome: Literal["won", "already"]
    packet_id: int
    grab: Grab
    remaining: int


def refusal_error(code: str) -> RedPacketError:
    """The error a grab answers with for ``code`` (``packet_empty``, ``packet_expired``, ``not_target``;
    anything else: ``packet_not_found``), whether Redis or the hub (``server.hub.known``) decided it."""
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


def parse_record(user_id: int, record: bytes | str) -> Grab:
    """``"seq:amount:ms"`` as stored in a packet's grabs hash."""
    text = record.decode() if isinstance(record, bytes) else record
    seq, amount, ms = text.split(":")
    return Grab(user_id, int(seq), int(amount), int(ms))


async def grab(core: Core, packet_id: int, group_id: int, user_id: int, gate: bool = False) -> GrabResult:
    """Take one share of a packet for ``user_id``, or the share they took before.

    One Lua call, one round trip, on the group's shard: the member check (Redis cache of the database),
    the block and rate limit when ``gate`` (the hub's), the share, and its credit record in the shard's
    outbox. A share is never taken without its credit recorded in the same atomic call. A second grab by
    the same user returns the same share. With durable grabs the answer waits until the grab is on disk
    or on a replica (``server.store.batch``). A cold member cache costs one database read and a second call;
    so does a live packet that Redis no longer knows, recovered from the database first; so does the
    first grab of a packet after Redis restarted or failed over (``server.store.repair``).
    """

    async def attempt(check_members: bool, gate: bool) -> tuple[str, Any]:
        keys_, args = grab_call(core, packet_id, group_id, user_id, check_members, gate)
        res = await core.batcher.script(core.scripts.grab, keys_, args, durable=_took_or_holds_a_share)
        return res[0].decode(), res

    try:
        first: Any = None
        for _ in range(3):
            generation = core.repairs.generation
            await core.repairs.ensure(packet_id, lambda: _check(core, packet_id))
            status, res = await attempt(True, gate)
            if status == "members":
                # The cache was cold and the script stopped before the gate: it still applies.
                await core.membership.require(group_id, user_id)
                status, res = await attempt(False, gate)
            if status == "unknown" and await _recover_if_live(core, packet_id, group_id):
                # This attempt passed the member check and the gate already: not charged twice.
                status, res = await attempt(False, False)
            if status == "already" and first is not None and first[0] == "won" and first[1][1] == res[1]:
                status, res = first  # it was this grab that won that share: say so (it is announced)
            if core.repairs.generation == generation:
                break
            # A Redis server restarted or failed over while this grab was in flight: check the packet
            # against the database, then ask again before answering (the same user gets the same share,
            # unless the database showed it to be someone else's).
            first = first or (status, res)
        else:
            raise Unavailable(errors.REDIS_UNAVAILABLE, "Redis keeps changing under this grab: retry")
    except RedisError as e:
        down = unavailable(e)
        if down is None:
            raise  # not Redis being away: a bug, answered internal and logged by the caller
        raise down from e
    if status == "not_member":
        raise not_member(group_id, user_id)
    if status == "blocked":
        raise Forbidden(errors.BLOCKED, "grabbing is blocked for this account for now")
    if status == "limited":
        raise Conflict(errors.RATE_LIMITED, f"too many grabs: try again in {int(res[1])} ms")
    if status in ("won", "already"):
        outcome: Literal["won", "already"] = "won" if status == "won" else "already"
        return GrabResult(outcome, packet_id, parse_record(user_id, res[1]), int(res[2]))
    raise _refusal(status)


def _took_or_holds_a_share(answer: Any) -> bool:
    """A grab answer that says a share is this user's ("won", "already") waits for durability."""
    return bool(answer) and answer[0] in (b"won", b"already")


async def _check(core: Core, packet_id: int) -> None:
    """The check of a packet after Redis may have lost writes: ``recover_packet``, for a packet the
    database has and still pays out (one it refunded, or never had, is answered by the grab itself)."""
    try:
        await recover_packet(core, packet_id)
    except (NotFound, Conflict):
        pass


def grab_call(
    core: Core, packet_id: int, group_id: int, user_id: int, check_members: bool, gate: bool
) -> tuple[list[str], list[Any]]:
    """The keys and arguments of one call of ``lua/grab.lua`` (its header says what each one is)."""
    s = core.settings
    meta, shares, grabs, _ = keys.packet_keys(group_id, packet_id)
    keys_ = [
        meta,
        shares,
        grabs,
        keys.group_members(group_id),
        keys.gate_for(group_id),
        keys.grab_bucket(group_id, user_id),
        keys.outbox_for(group_id),
    ]
    args = [
        user_id,
        group_id,
        packet_id,
        "1" if check_members else "0",
        s.grabs_per_second if gate else "",
        s.grabs_burst,
        keys.LOADED,
        "0" if s.durability == "none" else "1",
    ]
    return keys_, args


async def _recover_if_live(core: Core, packet_id: int, group_id: int) -> bool:
    row = await core.db.fetchone("SELECT group_id, status FROM red_packets WHERE id = %s", (packet_id,))
    if row is None or int(row[0]) != group_id or row[1] == "refunded":
        return False
    await recover_packet(core, packet_id)
    return True


async def call_script(core: Core, script: AsyncScript, keys_: list[str], args: list[Any]) -> Any:
    """EVALSHA in the core's next batch (one pipeline per master per loop tick)."""
    return await core.batcher.script(script, keys_, args)


@dataclass(frozen=True)
class PacketView:
    """What ``open`` shows: the packet, this user's share and the grab list in grab order."""

    packet_id: int
    group_id: int
    sender_id: int
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

    @property
    def duration_ms(self) -> int | None:
        """How long the packet took to empty."""
        return None if self.finished_ms is None else self.finished_ms - self.created_ms


def view_packet(
    packet_id: int, meta: dict[str, str], records: dict[int, Grab], remaining: int, user_id: int
) -> PacketView:
    """Build the view from a packet's meta fields and grabs. Pure."""
    grabs = sorted(records.values(), key=lambda g: (g.grabbed_ms, g.seq))
    count = int(meta["count"])
    finished = meta.get("finished_ms") or None
    finished_ms = int(finished) if finished else None
    if finished_ms is None and len(grabs) == count:
        finished_ms = grabs[-1].grabbed_ms
    # Best luck is only named once every share is out; ties go to whoever grabbed first.
    best = max(grabs, key=lambda g: (g.amount, -g.grabbed_ms, -g.seq)) if finished_ms and grabs else None
    return PacketView(
        packet_id=packet_id,
        group_id=int(meta["group"]),
        sender_id=int(meta["sender"]),
        kind=meta["kind"],
        total=int(meta["total"]),
        count=count,
        greeting=meta.get("greeting", ""),
        created_ms=int(meta["created_ms"]),
        expires_ms=int(meta["expires_ms"]),
        remaining=remaining,
        grabs=grabs,
        mine=records.get(user_id),
        finished_ms=finished_ms,
        best_luck=best,
    )


def _text(d: dict[Any, Any]) -> dict[str, str]:
    return {
        (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
        for k, v in d.items()
    }


async def open_packet(core: Core, packet_id: int, group_id: int, user_id: int) -> PacketView:
    """This user's result and the packet's grab list: one Redis round trip when the cache is warm.

    A read: calling it any number of times changes nothing. A packet whose Redis keys are gone (after its
    refund, or a Redis loss) is read from the database instead.
    """
    meta_key, shares_key, grabs_key, _ = keys.packet_keys(group_id, packet_id)
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
        if not loaded:
            member = await core.membership.is_member(group_id, user_id)
    except RedisError as e:
        raise Unavailable(errors.REDIS_UNAVAILABLE, str(e)) from e
    if not member:
        raise not_member(group_id, user_id)
    meta = _text(meta_raw)
    if meta and meta.get("group") == str(group_id):
        records = {int(u): parse_record(int(u), r) for u, r in _text(grabs_raw).items()}
        return view_packet(packet_id, meta, records, int(left), user_id)
    if meta:
        raise _refusal("unknown")
    return await _open_from_database(core, packet_id, group_id, user_id)


async def _open_from_database(core: Core, packet_id: int, group_id: int, user_id: int) -> PacketView:
    row = await core.db.fetchone(f"SELECT {_PACKET_COLUMNS} FROM red_packets WHERE id = %s", (packet_id,))
    if row is None or int(row[2]) != group_id:
        raise NotFound(errors.PACKET_NOT_FOUND, "no such packet in this group")
    p = _packet_from_row(row)
    rows = await core.db.fetchall(
        "SELECT user_id, seq, amount, grabbed_ms FROM grab_records WHERE packet_id = %s", (packet_id,)
    )
    records = {int(r[0]): Grab(int(r[0]), int(r[1]), int(r[2]), int(r[3])) for r in rows}
    meta = {
        "group": str(p.group_id),
        "sender": str(p.sender_id),
        "kind": p.kind,
        "total": str(p.total),
        "count": str(p.count),
        "greeting": p.greeting,
        "created_ms": str(p.created_ms),
        "expires_ms": str(p.expires_ms),
        "finished_ms": "" if row[12] is None else str(row[12]),
    }
    return view_packet(packet_id, meta, records, p.count - len(records), user_id)
