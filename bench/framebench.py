"""``redpacket bench frames``: CPU per websocket frame of the transport alone, for each core the hub could
parse frames with (pure CPU: no socket, no service).

Each side is taken through a real upgrade handshake, then handed the same client frames (a masked
msgpack ``ping`` request, 30 bytes, one frame per call as a socket read brings them) and asked for one
reply frame per request: websockets' Sans-I/O ``ServerProtocol`` (what the hub's handshake, control
frames and fragments go through), wsproto's ``Connection``, and the hub's own path for a whole message
(``server.hub.frames``: delimit, unmask, frame the reply). picows is not here: its frame parser lives
inside its own Cython protocol, which does its own HTTP upgrade and cannot take over a connection that
uvicorn upgraded.
"""

from __future__ import annotations

import base64
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack

from bench.report import report
from server.hub.frames import Kind, data_frame, next_frame, unmask

REQUEST = msgpack.packb({"id": 1, "type": "ping"})
REPLY = msgpack.packb({"type": "reply", "id": 1, "ok": True, "data": {"ts": 1_700_000_000_000}})
QUIET = logging.getLogger("bench.framebench.websockets")  # (not a line per connection)
QUIET.setLevel(logging.WARNING)
UPGRADE = (
    "GET /ws HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    f"Sec-WebSocket-Key: {base64.b64encode(os.urandom(16)).decode()}\r\nSec-WebSocket-Version: 13\r\n\r\n"
).encode()


def client_frames(n: int) -> list[bytes]:
    """``n`` masked binary frames of ``REQUEST``, each with its own mask, as a client sends them."""
    frames = []
    for _ in range(n):
        mask = os.urandom(4)
        body = bytes(b ^ mask[i % 4] for i, b in enumerate(REQUEST))
        frames.append(bytes([0x82, 0x80 | len(REQUEST)]) + mask + body)
    return frames


def websockets_core(frames: list[bytes]) -> int:
    from websockets.frames import Frame
    from websockets.server import ServerProtocol

    p = ServerProtocol(max_size=65536, logger=QUIET)
    p.receive_data(UPGRADE)
    (request,) = p.events_received()
    p.send_response(p.accept(request))  # type: ignore[arg-type]
    p.data_to_send()
    replies = 0
    for raw in frames:
        p.receive_data(raw)
        for event in p.events_received():
            if isinstance(event, Frame) and event.data == REQUEST:
                p.send_binary(REPLY)
        replies += len(p.data_to_send())
    return replies


def wsproto_core(frames: list[bytes]) -> int:
    from wsproto import ConnectionType, WSConnection
    from wsproto.events import AcceptConnection, BytesMessage, Request

    c = WSConnection(ConnectionType.SERVER)
    c.receive_data(UPGRADE)
    for event in c.events():
        if isinstance(event, Request):
            c.send(AcceptConnection())
    replies = 0
    for raw in frames:
        c.receive_data(raw)
        for event in c.events():
            if isinstance(event, BytesMessage) and event.data == REQUEST:
                replies += len(c.send(BytesMessage(data=REPLY))) > 0
    return replies


def hub_path(frames: list[bytes]) -> int:
    replies = 0
    for raw in frames:
        kind, start, end = next_frame(raw, 0, 65536)
        if kind is Kind.BINARY and unmask(raw, start, end) == REQUEST:
            replies += len(data_frame(REPLY)) > 0
    return replies


SIDES: dict[str, Callable[[list[bytes]], int]] = {
    "websockets": websockets_core,
    "wsproto": wsproto_core,
    "hub": hub_path,
}


def bench_frames(n: int = 50_000, rounds: int = 3, plot: Path | None = None) -> dict[str, Any]:
    """Each side ``rounds`` times, alternating; the best round's CPU per frame in and reply out."""
    frames = client_frames(n)
    best: dict[str, float] = {}
    for _ in range(rounds):
        for name, side in SIDES.items():
            cpu = time.process_time()
            replies = side(frames)
            us = (time.process_time() - cpu) * 1e6 / n
            if replies != n:  # (each side parsed every request and framed a reply to it)
                raise RuntimeError(f"bench frames: {name} answered {replies} of {n} requests")
            best[name] = min(best.get(name, us), us)
    figures: dict[str, Any] = {"frames": n, "rounds": rounds}
    for name, us in best.items():
        figures[f"{name}_cpu_us_per_frame"] = round(us, 2)
    figures["websockets_over_hub"] = round(best["websockets"] / best["hub"], 1)
    return report("frames", figures, plot)
