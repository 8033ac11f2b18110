"""One typed call per Lua script: its KEYS and ARGV built by name, its reply parsed into a typed result.

A script's inputs are positional (``KEYS[3]``, ``ARGV[8]``) and its reply a Lua table; here each script
has one dataclass whose fields name what it takes, whose ``keys()`` and ``argv()`` put them in the order
the script's header names them (each script opens by naming its KEYS and ARGV as locals), and whose
``parse`` turns the reply into a dataclass. Nothing else builds a script's arguments or reads its reply
by position. ``run`` sends a call in the batcher's next pipeline; ``run_alone`` sends it by itself (a
repair, a cache fill).

The flags a script takes are ``"1"``/``"0"`` on the wire (Lua compares strings) and ``bool`` here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Generic, Literal, TypeVar, get_args

from server.ids import GroupId, PacketId, UserId
from server.store import keys
from server.store.batch import Batcher, Durable
from server.store.records import CreditEntry, DroppedEntry, GrabRecord, ShareEntry
from server.store.scripts import Scripts

R = TypeVar("R")
# What redis-py sends as one argument.
Arg = str | int | float | bytes


def _flag(on: bool) -> str:
    return "1" if on else "0"


def _text(v: object) -> str:
    if isinstance(v, bytes):
        return v.decode()
    if isinstance(v, str | int):
        return str(v)
    raise ValueError(f"a script answered {v!r} where text was due")


def _int(v: object) -> int:
    if isinstance(v, int | bytes | str) and not isinstance(v, bool):
        return int(v)
    raise ValueError(f"a script answered {v!r} where a number was due")


def _raw(v: object) -> bytes | str:
    if isinstance(v, bytes | str):
        return v
    raise ValueError(f"a script answered {v!r} where a string was due")


def _list(v: object, n: int | None = None) -> list[object]:
    """A script's array reply (of ``n`` items, when given)."""
    if isinstance(v, list) and (n is None or len(v) == n):
        return v
    raise ValueError(f"a script answered {v!r} where {n or 'a list of'} items were due")


class Call(ABC, Generic[R]):
    """One call of ``lua/<SCRIPT>.lua``."""

    SCRIPT: ClassVar[str]
    # A grab: refused on a master whose eviction policy may drop keys (``Batcher.call``), where the share
    # it takes and its credit could vanish; what pays money out goes on.
    GUARDED: ClassVar[bool] = False

    @abstractmethod
    def keys(self) -> list[str]: ...

    @abstractmethod
    def argv(self) -> list[Arg]: ...

    @abstractmethod
    def parse(self, reply: object) -> R:
        """The script's reply (as redis-py hands it over: bytes, ints, lists) as a typed result; a reply of
        another shape raises ``ValueError``."""

    def durability(self) -> Durable:
        """Whether its reply is answered only once the call is durable (``server.store.batch``): False
        (the default: a pipeline of such calls neither reads the server's data id nor waits), True, or a
        test of the reply."""
        return False


async def run(batcher: Batcher, scripts: Scripts, call: Call[R]) -> R:
    """The call in the batcher's next pipeline to its slot's master; its parsed reply."""
    script = scripts.get(call.SCRIPT)
    reply = await batcher.script(
        script, call.keys(), call.argv(), durable=call.durability(), guarded=call.GUARDED
    )
    return call.parse(reply)


async def run_alone(scripts: Scripts, call: Call[R]) -> R:
    """The call on its own round trip (EVALSHA through the client, reloaded after a ``SCRIPT FLUSH``)."""
    reply = await scripts.get(call.SCRIPT)(keys=call.keys(), args=call.argv())
    return call.parse(reply)


# -- grab.lua --------------------------------------------------------------------------------------------

GrabStatus = Literal[
    "won",
    "already",
    "members",
    "not_member",
    "blocked",
    "limited",
    "empty",
    "expired",
    "not_target",
    "unknown",
]
_STATUSES: dict[str, GrabStatus] = {s: s for s in get_args(GrabStatus)}


# The grab's call and reply are made on every grab: slotted, not frozen (a frozen dataclass sets each field
# through object.__setattr__, 0.8 us against 0.3 for six fields). Nothing keeps or shares them.
@dataclass(slots=True)
class GrabRate:
    """The hub's gate on a grab: the block list and a rate limit of ``per_second`` with ``burst``."""

    per_second: float
    burst: int


def holds_a_share(reply: object) -> bool:
    """A grab's answer that says a share is this user's ("won", "already") waits for durability; a
    refusal does not."""
    return isinstance(reply, list) and bool(reply) and reply[0] in (b"won", b"already")


@dataclass(slots=True)
class GrabReply:
    status: GrabStatus
    record: GrabRecord | None = None  # won, already: the user's share
    remaining: int | None = None  # won, already: shares left
    wait_ms: int | None = None  # blocked: until the block ends; limited: until a grab is allowed


@dataclass(slots=True)
class GrabCall(Call[GrabReply]):
    """Take one share of a packet for a user (``lua/grab.lua``)."""

    SCRIPT = "grab"
    GUARDED = True
    user_id: UserId
    group_id: GroupId
    packet_id: PacketId
    check_members: bool  # False when the caller has just read the membership from the database
    rate: GrabRate | None  # None: no block list, no rate limit
    rewrite_repeat: bool  # a repeat grab writes its record again, for the durability wait to cover it
    trace: str = ""  # this call's span (a traceparent) for its credit record (``server.tracing``); '': none

    def keys(self) -> list[str]:
        g, p = self.group_id, self.packet_id
        return [
            keys.packet_meta(group_id=g, packet_id=p),
            keys.packet_shares(group_id=g, packet_id=p),
            keys.packet_grabs(group_id=g, packet_id=p),
            keys.group_members(g),
            keys.gate_for(g),
            keys.grab_bucket(group_id=g, user_id=self.user_id),
            keys.outbox_for(g),
        ]

    def argv(self) -> list[Arg]:
        rate = self.rate
        return [
            self.user_id,
            self.group_id,
            self.packet_id,
            _flag(self.check_members),
            "" if rate is None else rate.per_second,
            "" if rate is None else rate.burst,
            keys.LOADED,
            _flag(self.rewrite_repeat),
            *((self.trace,) if self.trace else ()),
        ]

    def parse(self, reply: object) -> GrabReply:
        items = _list(reply)
        status = _STATUSES.get(_text(items[0])) if items else None
        if status is None:
            raise ValueError(f"grab.lua answered {reply!r}")
        if status in ("won", "already"):
            _, record, left = _list(reply, 3)
            return GrabReply(status, GrabRecord.parse(_raw(record)), _int(left))
        if status in ("blocked", "limited"):
            return GrabReply(status, wait_ms=_int(_list(reply, 2)[1]))
        return GrabReply(status)

    def durability(self) -> Durable:
        return holds_a_share


# -- load_packet.lua -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Loaded:
    shares_left: int
    grabs_known: int
    dropped: list[DroppedEntry]  # every grab a repair of this packet ever took out


@dataclass(frozen=True)
class LoadPacketCall(Call[Loaded]):
    """Bring a packet's state into Redis from the database (``lua/load_packet.lua``)."""

    SCRIPT = "load_packet"
    group_id: GroupId
    packet_id: PacketId
    expire_at_ms: int
    meta: dict[str, Arg]
    shares: list[ShareEntry]  # every share of the packet, in hand-out order
    grabs: dict[UserId, GrabRecord]  # the grabs the database holds
    # The server this is loaded on, as the caller saw it (``Repairs.stamp``); "": not known, so none (a
    # process meeting the packet later checks it against the database).
    stamp: str = ""

    def keys(self) -> list[str]:
        return [
            *keys.packet_keys(group_id=self.group_id, packet_id=self.packet_id),
            keys.outbox_for(self.group_id),
        ]

    def argv(self) -> list[Arg]:
        args: list[Arg] = [self.expire_at_ms, self.packet_id, keys.PACKET_STAMP, self.stamp, len(self.meta)]
        for k, v in self.meta.items():
            args += [k, v]
        args.append(len(self.shares))
        args += [s.encode() for s in self.shares]
        args.append(len(self.grabs))
        for user, record in self.grabs.items():
            args += [user, record.encode()]
        return args

    def parse(self, reply: object) -> Loaded:
        left, known, dropped = _list(reply, 3)
        return Loaded(_int(left), _int(known), [DroppedEntry.parse(_raw(e)) for e in _list(dropped)])


# -- close_packet.lua ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Closed:
    present: bool  # the packet's keys were in Redis: if not, its grabs may be only in the outbox
    grabs: dict[UserId, GrabRecord]
    dropped: list[DroppedEntry]


@dataclass(frozen=True)
class ClosePacketCall(Call[Closed]):
    """Close a packet to grabs (or only mark it read) and read its grabs (``lua/close_packet.lua``)."""

    SCRIPT = "close_packet"
    group_id: GroupId
    packet_id: PacketId
    close: bool
    expire_at_ms: int  # of a meta hash the close itself makes

    def keys(self) -> list[str]:
        meta, _, grabs, dropped = keys.packet_keys(group_id=self.group_id, packet_id=self.packet_id)
        return [meta, grabs, dropped]

    def argv(self) -> list[Arg]:
        return [_flag(self.close), self.expire_at_ms]

    def parse(self, reply: object) -> Closed:
        present, held, gone = _list(reply, 3)
        pairs = _list(held)
        grabs = {
            UserId(_int(pairs[i])): GrabRecord.parse(_raw(pairs[i + 1])) for i in range(0, len(pairs), 2)
        }
        return Closed(_int(present) == 1, grabs, [DroppedEntry.parse(_raw(e)) for e in _list(gone)])

    def durability(self) -> Durable:
        return True  # "won" is never answered for less: what the refund reads is as durable as a grab


# -- ack_credits.lua -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AckCreditsCall(Call[int]):
    """Take paid (or refused) credits off a shard's outbox, and make Redis hold every paid share as its
    grabber's (``lua/ack_credits.lua``)."""

    SCRIPT = "ack_credits"
    shard: int
    entry_ids: list[bytes]
    paid: dict[tuple[GroupId, PacketId], list[CreditEntry]]

    def keys(self) -> list[str]:
        out = [keys.credit_outbox(self.shard)]
        for group, packet in self.paid:
            out += keys.packet_keys(group_id=group, packet_id=packet)[:3]  # meta, shares, grabs
        return out

    def argv(self) -> list[Arg]:
        args: list[Arg] = [keys.CREDIT_GROUP, len(self.entry_ids), *self.entry_ids]
        for credits in self.paid.values():
            args.append(len(credits))
            for c in credits:
                args += [c.user_id, c.share(), c.grabbed_ms]
        return args

    def parse(self, reply: object) -> int:
        return _int(reply)


# -- fill_members.lua ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FillMembersCall(Call[bool]):
    """Fill a group's member cache, unless a membership change raced the read (``lua/fill_members.lua``)."""

    SCRIPT = "fill_members"
    group_id: GroupId
    version: bytes  # the version counter read before the database was read (b"" if none)
    ttl_seconds: int
    members: frozenset[UserId]

    def keys(self) -> list[str]:
        return [keys.group_members(self.group_id), keys.group_members_version(self.group_id)]

    def argv(self) -> list[Arg]:
        return [self.version, self.ttl_seconds, keys.LOADED, *self.members]

    def parse(self, reply: object) -> bool:
        return _int(reply) == 1  # False: a membership change raced the read, and nothing was cached


# -- publish_event.lua -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Once:
    """Publish an event at most once: ``name`` identifies it within its group (``packet:17``); a second
    publish within ``ttl_seconds`` returns the first one's offset and publishes nothing."""

    name: str
    ttl_seconds: int


@dataclass(frozen=True)
class PublishEventCall(Call[str]):
    """Append an event to a group's stream and publish it; its offset (``lua/publish_event.lua``)."""

    SCRIPT = "publish_event"
    group_id: GroupId
    payload: bytes
    max_length: int
    ttl_seconds: int
    once: Once | None

    def keys(self) -> list[str]:
        out = [keys.group_events(self.group_id)]
        if self.once is not None:
            out.append(keys.group_once(self.group_id, self.once.name))
        return out

    def argv(self) -> list[Arg]:
        args: list[Arg] = [keys.group_channel(self.group_id), self.max_length, self.payload, self.ttl_seconds]
        if self.once is not None:
            args.append(self.once.ttl_seconds)
        return args

    def parse(self, reply: object) -> str:
        return _text(reply)


# -- read_events.lua -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stream:
    """A group's stream at one moment: its figures and the entries after an offset."""

    length: int
    added: int  # entries ever added
    first: str  # "" when empty
    last: str
    rows: list[tuple[str, bytes]]  # (offset, payload)


@dataclass(frozen=True)
class ReadEventsCall(Call[Stream | None]):
    """What a group's stream holds after an offset, or None when there is no stream
    (``lua/read_events.lua``)."""

    SCRIPT = "read_events"
    group_id: GroupId
    after: str
    limit: int

    def keys(self) -> list[str]:
        return [keys.group_events(self.group_id)]

    def argv(self) -> list[Arg]:
        return [self.after, self.limit]

    def parse(self, reply: object) -> Stream | None:
        items = _list(reply)
        if not items or _int(items[0]) == 0:
            return None
        _, length, added, first, last, rows = _list(reply, 6)
        out = []
        for row in _list(rows):
            rid, fields = _list(row, 2)
            flat = _list(fields)
            payload = dict(zip(flat[::2], flat[1::2], strict=True))[b"e"]
            if not isinstance(payload, bytes):
                raise ValueError(f"read_events.lua answered an event of {payload!r}")
            out.append((_text(rid), payload))
        return Stream(_int(length), _int(added), _text(first or b""), _text(last or b""), out)


# -- presence.lua ----------------------------------------------------------------------------------------

PresenceAction = Literal["join", "refresh", "leave"]


@dataclass(frozen=True)
class PresenceCall(Call[list[UserId]]):
    """This hub's connections of ``users`` joined, refreshed or left a group; who came online or went
    offline because of it (``lua/presence.lua``)."""

    SCRIPT = "presence"
    group_id: GroupId
    hub_id: str
    action: PresenceAction
    lapse_ms: int
    users: list[UserId]

    def keys(self) -> list[str]:
        g = self.group_id
        return [keys.presence_online(g), *(keys.presence_hubs(group_id=g, user_id=u) for u in self.users)]

    def argv(self) -> list[Arg]:
        return [self.action, self.hub_id, self.lapse_ms, *self.users]

    def parse(self, reply: object) -> list[UserId]:
        return [u for u, changed in zip(self.users, _list(reply, len(self.users)), strict=True) if changed]
