"""WebSocket frames written by hand, as a client writes them (RFC 6455): for tests that feed the hub's
frame reader bytes a library client would never send."""

from __future__ import annotations

import os
import struct

PING, PONG, CONT, TEXT, BINARY, CLOSE = 0x9, 0xA, 0x0, 0x1, 0x2, 0x8


def frame(opcode: int, payload: bytes = b"", fin: bool = True, mask: bytes | None = None) -> bytes:
    """A client frame (masked, as RFC 6455 requires of a client; a random mask unless given), payload
    under 64 KB."""
    mask = os.urandom(4) if mask is None else mask
    body = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    first, n = (0x80 if fin else 0) | opcode, len(payload)
    head = struct.pack("!BB", first, 0x80 | n) if n < 126 else struct.pack("!BBH", first, 0x80 | 126, n)
    return head + mask + body
