"""``server.hub.frames``: where a client frame ends and which frames the hub reads itself."""

from __future__ import annotations

import os
import struct

import pytest

from server.hub.frames import Kind, next_frame, unmask


def client_frame(first: int, payload: bytes, masked: bool = True) -> bytes:
    """A frame as a client writes it: ``first`` byte (FIN, RSV, opcode), the length in its three forms."""
    n = len(payload)
    length = n if n < 126 else 126 if n < 65536 else 127
    head = struct.pack("!BB", first, (0x80 if masked else 0) | length)
    head += b"" if n < 126 else struct.pack("!H", n) if n < 65536 else struct.pack("!Q", n)
    if not masked:
        return head + payload
    mask = os.urandom(4)
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 125, 126, 127, 65535, 65536, 70001])
def test_a_whole_message_is_found_at_every_length_and_unmasked(n: int) -> None:
    payload = os.urandom(n)
    raw = b"junk" + client_frame(0x82, payload) + b"next"
    span = next_frame(raw, 4, 1 << 20)
    assert span.kind is Kind.BINARY and raw[span.end :] == b"next"
    assert unmask(raw, span.start, span.end) == payload


def test_a_frame_cut_anywhere_is_partial_and_says_its_end_once_its_header_is_here() -> None:
    raw = client_frame(0x81, b"x" * 300)  # a two-byte extended length: the end is known after 4 bytes
    for cut in range(len(raw)):
        span = next_frame(raw[:cut], 0, 1 << 20)
        assert span.kind is Kind.PARTIAL
        assert span.end == (len(raw) if cut >= 4 else 0)
    assert next_frame(raw, 0, 1 << 20).kind is Kind.TEXT


@pytest.mark.parametrize(
    "first, masked",
    [
        (0x01, True),  # a text message's first fragment (no FIN)
        (0x80, True),  # a continuation
        (0x89, True),  # a ping
        (0x8A, True),  # a pong
        (0x88, True),  # a close
        (0xC1, True),  # a reserved bit
        (0x83, True),  # a reserved opcode
        (0x82, False),  # not masked
    ],
)
def test_every_other_frame_is_delimited_for_websockets(first: int, masked: bool) -> None:
    raw = client_frame(first, b"abc", masked)
    assert next_frame(raw + b"more", 0, 1 << 20) == (Kind.OTHER, len(raw) - 3, len(raw))


def test_a_frame_declared_over_the_limit_is_too_large_before_its_payload_comes() -> None:
    header = struct.pack("!BBQ", 0x82, 0x80 | 127, 1 << 40)
    assert next_frame(header, 0, 65536).kind is Kind.TOO_LARGE
    assert next_frame(client_frame(0x82, b"x" * 101), 0, 100).kind is Kind.TOO_LARGE
    assert next_frame(client_frame(0x82, b"x" * 100), 0, 100).kind is Kind.BINARY
