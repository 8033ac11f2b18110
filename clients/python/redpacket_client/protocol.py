"""The names the hub's websocket protocol fixes (docs/protocol.md): its subprotocols, how a token is
offered, and the order of a group's event offsets. The hub reads them from here too, so a client and the
hub cannot disagree on one."""

from __future__ import annotations

from typing import Literal

SUBPROTOCOL_MSGPACK = "redpacket.v1.msgpack"
SUBPROTOCOL_JSON = "redpacket.v1.json"
# Version 2: the same messages, with every user, group and packet id a decimal string.
SUBPROTOCOL_MSGPACK_V2 = "redpacket.v2.msgpack"
SUBPROTOCOL_JSON_V2 = "redpacket.v2.json"
# A token goes as one more subprotocol, ``bearer.<token>``, out of the URL ("Connecting").
TOKEN_SUBPROTOCOL = "bearer."
Format = Literal["msgpack", "json"]


def offset_key(offset: str | bytes) -> tuple[int, int]:
    """Offsets are Redis stream ids ``<ms>-<seq>``; this orders them."""
    text = offset.decode() if isinstance(offset, bytes) else offset
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)
