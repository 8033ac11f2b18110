"""Where each client frame in a buffer ends, and which frames the hub reads itself (RFC 6455 section 5.2).

Nearly every frame a client sends is one whole, masked text or binary message with no extension bit:
``server.hub.wire`` unmasks and hands those on itself (~0.5 µs a frame). Every other frame (ping, pong,
close, a fragment, an unmasked or reserved one) goes to websockets' parser whole, so that parser's
buffer is always empty between frames and its state (the close, a fragmented message) stays right.
websockets' parser costs ~3 µs a frame in pure Python, the hub's fast path a sixth of that
(``redpacket bench frames``).
"""

from __future__ import annotations

import enum
import struct
from typing import NamedTuple


class Kind(enum.Enum):
    TEXT = "text"  # a whole, masked text message: the hub's own
    BINARY = "binary"  # a whole, masked binary message: the hub's own
    OTHER = "other"  # a whole frame for websockets' parser
    PARTIAL = "partial"  # not all here yet (``end``: where it will end, once its header is here; else 0)
    TOO_LARGE = "too_large"  # declares more than the message size limit: websockets refuses it (1009)


class Span(NamedTuple):
    kind: Kind
    start: int  # the payload's first byte (after the mask)
    end: int  # the byte after the frame


_PARTIAL = Span(Kind.PARTIAL, 0, 0)
_TOO_LARGE = Span(Kind.TOO_LARGE, 0, 0)
# The first byte of a whole message frame: FIN set, no reserved bit, opcode text (1) or binary (2).
_WHOLE_TEXT, _WHOLE_BINARY = 0x81, 0x82
_TEXT, _BINARY = 0x1, 0x2


def next_frame(buf: bytes | bytearray, at: int, max_size: int) -> Span:
    """The frame that begins at ``buf[at]``."""
    have = len(buf) - at
    if have < 2:
        return _PARTIAL
    first, second = buf[at], buf[at + 1]
    length, head = second & 0x7F, at + 2
    if length == 126:
        if have < 4:
            return _PARTIAL
        length, head = int.from_bytes(buf[at + 2 : at + 4], "big"), at + 4
    elif length == 127:
        if have < 10:
            return _PARTIAL
        length, head = int.from_bytes(buf[at + 2 : at + 10], "big"), at + 10
    if length > max_size:
        return _TOO_LARGE
    masked = second & 0x80
    start = head + 4 if masked else head
    end = start + length
    if end > len(buf):
        return Span(Kind.PARTIAL, 0, end)
    if masked and first == _WHOLE_BINARY:
        return Span(Kind.BINARY, start, end)
    if masked and first == _WHOLE_TEXT:
        return Span(Kind.TEXT, start, end)
    return Span(Kind.OTHER, start, end)


def unmask(buf: bytes | bytearray, start: int, end: int) -> bytes:
    """The payload of the masked frame whose payload is ``buf[start:end]`` (its mask the 4 bytes before)."""
    n = end - start
    if n == 0:
        return b""
    key = buf[start - 4 : start] * (n // 4 + 1)
    data = int.from_bytes(buf[start:end], "big") ^ int.from_bytes(key[:n], "big")
    return data.to_bytes(n, "big")


def data_frame(payload: bytes | str) -> bytes:
    """A whole, unmasked server data frame: binary for bytes, text for str (RFC 6455 section 5.2)."""
    if isinstance(payload, str):
        body, first = payload.encode(), 0x80 | _TEXT
    else:
        body, first = payload, 0x80 | _BINARY
    n = len(body)
    if n < 126:
        return struct.pack("!BB", first, n) + body
    if n < 65536:
        return struct.pack("!BBH", first, 126, n) + body
    return struct.pack("!BBQ", first, 127, n) + body
