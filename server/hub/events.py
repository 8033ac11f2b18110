"""Group events: published once to Redis (a capped stream for recovery plus pub/sub for live fan-out,
in one atomic script) and read back for a reconnecting client.

An event's payload is msgpack ``{"event": kind, "data": {...}}``; its offset is its stream id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack
from redis.exceptions import ResponseError

from server.core import Core
from server.hub.protocol import offset_key
from server.money.packets import call_script
from server.store import keys


def pack(kind: str, data: dict[str, Any]) -> bytes:
    return msgpack.packb({"event": kind, "data": data}, use_bin_type=True)  # type: ignore[no-any-return]


def unpack(payload: bytes) -> tuple[str, dict[str, Any]]:
    body = msgpack.unpackb(payload, raw=False)
    return str(body["event"]), dict(body["data"])


@dataclass(frozen=True)
class Once:
    """Publish an event at most once: ``name`` identifies it within its group (``packet:17``); a second
    publish within ``ttl_seconds`` returns the first one's offset and publishes nothing."""

    name: str
    ttl_seconds: int


async def publish(
    core: Core, group_id: int, kind: str, data: dict[str, Any], once: Once | None = None
) -> str:
    """Publish one event to a group; returns its offset. With ``once``, safe to retry after a failure
    whose outcome is unknown (a lost reply): it is published once."""
    s = core.settings
    keys_ = [keys.group_events(group_id)]
    args: list[Any] = [keys.group_channel(group_id), s.stream_maxlen, pack(kind, data), s.stream_ttl_seconds]
    if once is not None:
        keys_.append(keys.group_once(group_id, once.name))
        args.append(once.ttl_seconds)
    offset = await call_script(core, core.scripts.publish_event, keys_, args)
    return _text(offset)


async def published(core: Core, group_id: int, name: str) -> str | None:
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


async def since(core: Core, group_id: int, offset: str, limit: int) -> Missed:
    """Events of a group after ``offset`` (exclusive), or too_old if the stream no longer holds them all.
    One script call reads the stream's figures and the events at one moment (``lua/read_events.lua``)."""
    try:
        got = await call_script(
            core, core.scripts.read_events, [keys.group_events(group_id)], [offset, limit + 1]
        )
    except ResponseError:
        return Missed([], too_old=True)  # not a stream (or an offset Redis cannot read): start over
    if not got or int(got[0]) == 0:
        return Missed([], too_old=True)
    _, length, added, first, last, rows = got
    # Events leave the stream only by trimming at its head. If the client's offset is older than the
    # first event kept and anything was ever trimmed, some of what it missed may be gone.
    # (An emptied stream keeps only its last id: anything before it is gone.)
    ever_trimmed = int(added) > int(length)
    kept_from = first if int(length) else last
    if (ever_trimmed and offset_key(offset) < offset_key(kept_from or b"0-0")) or len(rows) > limit:
        return Missed([], too_old=True)
    if offset_key(offset) > offset_key(last or b"0-0"):
        # Past the newest event: an offset from before Redis lost the group's events (or from
        # elsewhere). What the client holds cannot be trusted: start over, as for a group with none.
        return Missed([], too_old=True)
    out = []
    for rid, fields in rows:
        kind, data = unpack(dict(zip(fields[::2], fields[1::2], strict=True))[b"e"])
        out.append((rid.decode() if isinstance(rid, bytes) else rid, kind, data))
    return Missed(out, too_old=False)


async def latest_offset(core: Core, group_id: int) -> str:
    """The offset of the group's newest event ("0-0" when it has none): where a fresh client starts."""
    stream = keys.group_events(group_id)
    rows = await core.batcher.call(lambda pipe: pipe.xrevrange(stream, count=1), stream)
    if not rows:
        return "0-0"
    rid = rows[0][0]
    return rid.decode() if isinstance(rid, bytes) else str(rid)
