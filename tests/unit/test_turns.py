"""``server.hub.wire``: what one socket sent at once is parsed a bounded turn at a time, the rest waiting
(its reading paused) until the loop has been round the other sockets. In-process, over a fake transport:
a burst of 5,000 tiny frames read in one go must not be parsed in one callback (under uvloop a flooding
socket is read back to back, and websockets parses in pure Python)."""

from __future__ import annotations

import asyncio
import base64
import os
from typing import Any

import uvicorn
from uvicorn.server import ServerState

from server.hub.wire import TURN_BYTES, TURN_FRAMES, HubWebSocket
from tests.wsframes import TEXT, frame


class FakeTransport(asyncio.Transport):
    """What the hub's protocol calls on a transport, recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.out = bytearray()
        self.paused = False
        self.closed = False

    def write(self, data: Any) -> None:
        self.out += data

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 50000), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.closed = True

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True


class Heard:
    def __init__(self) -> None:
        self.messages: list[bytes | str] = []

    def on_message(self, data: bytes | str) -> None:
        self.messages.append(data)

    def on_writable(self) -> None:
        pass

    def on_gone(self) -> None:
        pass

    def on_limited(self, limit: str) -> None:
        pass


async def _accepting(scope: Any, receive: Any, send: Any) -> None:
    assert (await receive())["type"] == "websocket.connect"
    await send({"type": "websocket.accept"})
    await asyncio.get_running_loop().create_future()  # the socket stays open (cancelled at the end)


async def test_a_burst_read_at_once_is_parsed_a_bounded_turn_at_a_time() -> None:
    config = uvicorn.Config(_accepting, ws_ping_interval=None, log_level="warning")
    config.load()
    state = ServerState()
    wire = HubWebSocket(config, state, {})
    transport = FakeTransport()
    wire.connection_made(transport)
    key = base64.b64encode(os.urandom(16)).decode()
    wire.data_received(
        f"GET /ws HTTP/1.1\r\nHost: hub\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode()
    )
    for _ in range(100):  # the app's task accepts
        if wire.phase == "open":
            break
        await asyncio.sleep(0)
    assert wire.phase == "open" and transport.out.startswith(b"HTTP/1.1 101")
    heard = Heard()
    wire.listen(heard)

    n = 5000
    wire.data_received(frame(TEXT, b"1") * n)  # 35 KB read in one go
    first = len(heard.messages)
    # One turn: at most TURN_FRAMES frames, or what one TURN_BYTES chunk holds (7-byte frames here).
    assert 0 < first <= max(TURN_FRAMES, TURN_BYTES // 7 + 1), first
    assert transport.paused  # the rest waits; the socket is not read meanwhile
    turns = 1
    while len(heard.messages) < n:
        await asyncio.sleep(0)  # one loop iteration: the other sockets' reads, then the next turn
        turns += 1
        assert turns < 10 * n // first
    assert heard.messages == ["1"] * n and turns >= n // first
    assert not transport.paused
    for task in state.tasks:
        task.cancel()
