"""The websocket protocol, version 1: frame codecs, request parsing, replies and events. Pure: no I/O.

``docs/protocol.md`` is the reference for clients; this module is its implementation. A binary frame is
msgpack, a text frame is JSON; a connection's own frames go out in the format it chose at connect (by
subprotocol). Every request ``{"id", "type", ...}`` gets exactly one reply with the same id.
"""

from __future__ import annotations

import json
import re
import reprlib
from dataclasses import dataclass
from typing import Any, Literal

import msgpack

from redpacket_client.protocol import (
    SUBPROTOCOL_JSON,
    SUBPROTOCOL_JSON_V2,
    SUBPROTOCOL_MSGPACK,
    SUBPROTOCOL_MSGPACK_V2,
    TOKEN_SUBPROTOCOL,
    Format,
)
from server import errors, text
from server.errors import NotFound, RedPacketError
from server.ids import MAX_ID, ids_as_text, ids_from_text


@dataclass(frozen=True, slots=True)
class Dialect:
    """What one connection speaks, chosen by subprotocol at connect: its encoding and its protocol
    version (1: ids are integers; 2: ids are decimal strings both ways, exact in any language)."""

    format: Format
    version: Literal[1, 2]
    subprotocol: str | None

    @property
    def text_ids(self) -> bool:
        return self.version == 2


DIALECTS = {
    d.subprotocol: d
    for d in (
        Dialect("msgpack", 1, SUBPROTOCOL_MSGPACK),
        Dialect("json", 1, SUBPROTOCOL_JSON),
        Dialect("msgpack", 2, SUBPROTOCOL_MSGPACK_V2),
        Dialect("json", 2, SUBPROTOCOL_JSON_V2),
    )
}
# A client that offers none of ours: msgpack, version 1 (what the hub always spoke to it).
NO_SUBPROTOCOL = Dialect("msgpack", 1, None)

# Close codes (1xxx from RFC 6455, 4xxx ours).
CLOSE_NORMAL = 1000
CLOSE_TOO_BIG = 1009  # a frame over the size limit (sent by the server's websocket layer)
CLOSE_POLICY = 1008  # refused before the upgrade (an Origin not allowed): the client sees HTTP 403
# More ping, pong, close and continuation frames in a second than REDPACKET_WS_FRAMES_PER_SECOND (reason
# "frame_flood"); the same code as a policy refusal, after the upgrade.
CLOSE_FLOOD = 1008
CLOSE_RESTART = 1012  # the hub is shutting down: reconnect, to another hub if you can
CLOSE_TRY_AGAIN = 1013  # a backing service is down or slow: reconnect after a moment
CLOSE_UNAUTHORIZED = 4001  # missing, malformed, tampered or expired token
CLOSE_HEARTBEAT = 4002  # nothing heard from the client within the heartbeat timeout
CLOSE_USER_UNKNOWN = 4004  # a valid token for a user the hub does not have (never provisioned)
CLOSE_SLOW_CONSUMER = 4008  # the client did not read fast enough: its send queue overflowed
CLOSE_RATE_LIMITED = 4029  # the client kept sending past its rate limit
CLOSE_TOO_MANY_SOCKETS = 4030  # this user has REDPACKET_MAX_SOCKETS_PER_USER sockets open on this hub

REQUEST_TYPES = ("ping", "sync", "chat", "send", "grab", "open", "presence")
MAX_TEXT_CHARS = 2000
# At most this much of a value the client sent is quoted back in an error message (``quoted``).
QUOTED_CHARS = 64


# A request's body as decoded from the wire: each field is checked where it is read (``field_int``,
# ``field_id``, the handlers), so its values are only ``object`` here.
Body = dict[str, object]
# A reply or an event as sent: JSON-shaped values.
Message = dict[str, object]


class ProtocolError(RedPacketError):
    pass


@dataclass(frozen=True)
class Request:
    id: int | str
    type: str
    body: Body


def choose_dialect(offered: list[str]) -> Dialect:
    """The dialect for a connection: the first of ours the client offered (``NO_SUBPROTOCOL`` if none;
    its ``subprotocol`` is the one to accept)."""
    for sub in offered:
        dialect = DIALECTS.get(sub)
        if dialect is not None:
            return dialect
    return NO_SUBPROTOCOL


# A token is offered as a subprotocol (a browser cannot set a header on a websocket, and a URL is logged):
# ``Sec-WebSocket-Protocol: redpacket.v1.json, bearer.<token>`` (``TOKEN_SUBPROTOCOL``). Never accepted
# back.


def offered_token(offered: list[str]) -> str | None:
    """The token a client offered as a ``bearer.<token>`` subprotocol, if any."""
    for sub in offered:
        if sub.startswith(TOKEN_SUBPROTOCOL) and len(sub) > len(TOKEN_SUBPROTOCOL):
            return sub[len(TOKEN_SUBPROTOCOL) :]
    return None


def origin_allowed(origin: str | None, host: str | None, allowed: tuple[str, ...]) -> bool:
    """Whether a websocket upgrade from a page of ``origin`` may connect. ``allowed`` empty: any (the
    default: clients that are not browsers send no Origin). ``self``: the hub's own pages (an origin
    whose host and port are the request's Host). A request with no Origin (not from a browser) passes:
    the allow-list keeps other sites' pages out, not other programs."""
    if not allowed or origin is None:
        return True
    origin = origin.lower().rstrip("/")
    if origin in allowed:
        return True
    if "self" in allowed and host:
        return origin in (f"http://{host.lower()}", f"https://{host.lower()}")
    return False


def decode(frame: bytes | str) -> object:
    """A frame's message: msgpack from bytes, JSON from text."""
    try:
        if isinstance(frame, bytes):
            return msgpack.unpackb(frame, raw=False, strict_map_key=True)
        return json.loads(frame)
    except Exception as e:
        raise ProtocolError(errors.BAD_FRAME, "the frame is not valid msgpack or JSON") from e


def encode(dialect: Dialect, message: Message) -> bytes | str:
    if dialect.text_ids:
        message = ids_as_text(message)
    if dialect.format == "msgpack":
        return msgpack.packb(message, use_bin_type=True)
    return json.dumps(message, ensure_ascii=False, separators=(",", ":"))


def parse_request(message: object, max_depth: int, text_ids: bool = False) -> Request:
    """Validate the envelope of a request; the fields of each type are checked by its handler. A message
    nested deeper than ``max_depth``, or with a lone surrogate in a string, is a bad request. ``text_ids``
    (version 2): ids may come as decimal strings, and are integers to the handlers."""
    if not isinstance(message, dict):
        raise ProtocolError(errors.BAD_REQUEST, "a request is a map")
    if request_id_of(message) is None:
        raise ProtocolError(
            errors.BAD_REQUEST, "id must be a 64-bit integer or a string of at most 64 characters"
        )
    problem = text.message_problem(message, max_depth)
    if problem is not None:
        raise ProtocolError(errors.BAD_REQUEST, problem)
    rid = message["id"]
    kind = message.get("type")
    if kind not in REQUEST_TYPES:
        raise ProtocolError(errors.UNKNOWN_TYPE, f"unknown request type {quoted(kind)}")
    body: Body = message
    if text_ids:
        try:
            body = ids_from_text(message)
        except ValueError as e:
            raise ProtocolError(errors.BAD_REQUEST, str(e)) from None
    return Request(rid, str(kind), body)


def quoted(value: object) -> str:
    """A value the client sent, as an error message names it: its ``repr`` in at most ``QUOTED_CHARS``
    characters, then "… (truncated)" if it was cut — a 60 KB ``type`` is not echoed whole (nor its
    escapes, four times that). The work is bounded too, however big the value."""
    if isinstance(value, str | bytes):
        whole = repr(value[: QUOTED_CHARS + 1])
    else:
        whole = reprlib.repr(value)  # a container or a number: reprlib elides what is long
    return whole if len(whole) <= QUOTED_CHARS else f"{whole[:QUOTED_CHARS]}… (truncated)"


def request_id_of(message: object) -> int | str | None:
    """The id to answer a request with, if it is a valid one: a 64-bit integer, or a string of at most
    64 characters that is text (any other is answered with null)."""
    if isinstance(message, dict):
        rid = message.get("id")
        if isinstance(rid, int) and not isinstance(rid, bool) and -(2**63) <= rid < 2**64:
            return rid
        if isinstance(rid, str) and len(rid) <= 64 and not text.has_surrogates(rid):
            return rid
    return None


def field_int(body: Body, name: str) -> int:
    v = body.get(name)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ProtocolError(errors.BAD_REQUEST, f"{name} must be an integer")
    return v


def field_id(body: Body, name: str, unknown: str) -> int:
    """An id field: an integer (else ``bad_request``); ``NotFound(unknown)`` when no id can be that
    number (a database would fail on it, not find nothing)."""
    v = field_int(body, name)
    if not 1 <= v <= MAX_ID:
        raise NotFound(unknown, f"no {name} {v}")
    return v


def reply_ok(rid: int | str, data: Message) -> Message:
    return {"type": "reply", "id": rid, "ok": True, "data": data}


def reply_error(
    rid: int | str | None, code: str, message: str, details: dict[str, object] | None = None
) -> Message:
    error = {**details, "code": code, "message": message} if details else {"code": code, "message": message}
    return {"type": "reply", "id": rid, "ok": False, "error": error}


def event(group: int, offset: str, kind: str, data: Message) -> Message:
    return {"type": "event", "group": group, "offset": offset, "event": kind, "data": data}


_OFFSET = re.compile(r"([0-9]{1,20})(?:-([0-9]{1,20}))?", re.ASCII)


def parse_offset(value: object) -> str | None:
    """A client's last offset of a group: null, or ``"<ms>-<seq>"`` as events carry it (``"<ms>"`` alone
    means ``"<ms>-0"``). Anything else is ``bad_request``."""
    if value is None:
        return None
    m = _OFFSET.fullmatch(value) if isinstance(value, str) else None
    if m is None or int(m[1]) >= 2**64 or int(m[2] or 0) >= 2**64:
        raise ProtocolError(
            errors.BAD_REQUEST, "an offset is null or a string '<ms>-<seq>' as events carry it"
        )
    return f"{int(m[1])}-{int(m[2] or 0)}"


def grabs_announcement(items: list[dict[str, Any]], listed: int | None) -> dict[str, Any]:
    """The data of a ``grabs`` event for the grabs of one interval, in grab order. ``listed`` (big
    rooms): only the latest that many grabs, how many more there were, and every packet's shares left
    — so what a storm sends each member grows with time, not with the number of grabs."""
    if listed is None or len(items) <= listed:
        return {"grabs": items}
    left: dict[str, int] = {}
    for item in items:
        key = str(item["packet_id"])
        left[key] = min(left.get(key, item["remaining"]), item["remaining"])
    return {"grabs": items[len(items) - listed :], "more": len(items) - listed, "remaining": left}


def announce_interval(base: float, online: int, big_room: int, frames_per_second: int) -> float:
    """Seconds between two grab announcements of one room from one hub."""
    if online <= big_room:
        return base
    return max(base, online / frames_per_second)
