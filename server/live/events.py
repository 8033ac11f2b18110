"""Group events: published once to Redis (a capped stream for recovery plus pub/sub for live fan-out,
in one atomic script) and read back for a reconnecting client.

An event's payload is msgpack ``{"event": kind, "data": {...}}``; its offset is its stream id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack
from redis.exceptions import ResponseError

from redpacket_client.protocol import offset_key
from server.core import Core
from server.ids import GroupId
from server.store import keys
from server.store.scriptcalls import Once, PublishEventCall, ReadEventsCall, run


def pack(kind: str, data: dict[str, Any]) -> bytes:
    return msgpack.packb({"event": kind, "data": data}, use_bin_type=True)


def unpack(payload: bytes) -> tuple[str, dict[str, Any]]:
    body = msgpack.unpackb(payload, raw=False)
    return str(body["event"]), dict(body["data"])


async def publish(
    core: Core, group_id: GroupId, kind: str, data: dict[str, Any], once: Once | None = None
) -> str:
    """Publish one event to a group; returns its offset. With ``once``, safe to retry after a failure
    whose outcome is unknown (a lost reply): it is published once."""
    s = core.settings
    call = PublishEventCall(
        group_id=group_id,
        payload=pack(kind, data),
        max_length=s.stream_maxlen,
        ttl_seconds=s.stream_ttl_seconds,
        once=once,
    )
    return await run(core.batcher, core.scripts, call)


async def published(core: Core, group_id: GroupId, name: str) -> str | None:
    """The offset of a once-published event, or None if it was not published (or is forgotten)."""
    key = keys.group_once(group_id, name)
    offset = await core.batcher.call(lambda pipe: pipe.get(key), key)
    return None if offset is None else _text(offset)


def _text(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


@dataclass(frozen=True)
class Missed:
    """What a client missed since an offset: the events in order, or ``too_old`` when some were trimmed."""

    events: list[tuple[str, str, dict[str, Any]]]  # (offset, kind, data)
    too_old: bool


async def since(core: Core, group_id: GroupId, offset: str, limit: int) -> Missed:
    """Events of a group after ``offset`` (exclusive), or too_old if the stream no longer holds them all.
    One script call reads the stream's figures and the events at one moment (``lua/read_events.lua``)."""
    try:
        stream = await run(
            core.batcher, core.scripts, ReadEventsCall(group_id=group_id, after=offset, limit=limit + 1)
        )
    except ResponseError:
        return Missed([], too_old=True)  # not a stream (or an offset Redis cannot read): start over
    if stream is None:
        return Missed([], too_old=True)
    # Events leave the stream only by trimming at its head. If the client's offset is older than the
    # first event kept and anything was ever trimmed, some of what it missed may be gone.
    # (An emptied stream keeps only its last id: anything before it is gone.)
    ever_trimmed = stream.added > stream.length
    kept_from = stream.first if stream.length else stream.last
    rows = stream.rows
    if (ever_trimmed and offset_key(offset) < offset_key(kept_from or "0-0")) or len(rows) > limit:
        return Missed([], too_old=True)
    if offset_key(offset) > offset_key(stream.last or "0-0"):
        # Past the newest event: an offset from before Redis lost the group's events (or from
        # elsewhere). What the client holds cannot be trusted: start over, as for a group with none.
        return Missed([], too_old=True)
    out = []
    for rid, payload in rows:
        kind, data = unpack(payload)
        out.append((rid, kind, data))
    return Missed(out, too_old=False)


async def latest_offset(core: Core, group_id: GroupId) -> str:
    """The offset of the group's newest event ("0-0" when it has none): where a fresh client starts."""
    stream = keys.group_events(group_id)
    rows = await core.batcher.call(lambda pipe: pipe.xrevrange(stream, count=1), stream)
    if not rows:
        return "0-0"
    rid = rows[0][0]
    return rid.decode() if isinstance(rid, bytes) else str(rid)
