"""A client process of ``redpacket bench hot`` (``python -m bench.hotclient``, started by
``bench.hotbench``): its slice of the clients, driven by one JSON command a line on stdin, each
answered by one JSON line on stdout.

The client must be faster than what it measures: picows (a websocket client in Cython) with a callback
per frame, replies told from events by their first bytes, and only a client's own reply decoded. Times
are ``time.monotonic`` (one clock for every process on the machine).
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import sys
import time
from typing import Any, cast

import msgpack
import uvloop
from picows import WSFrame, WSListener, WSMsgType, WSTransport, ws_connect

WINDOW = 500  # handshakes in flight per client process, unless the driver says (several processes)
TRIES = 5  # a socket refused before its welcome (1013: the hub could not welcome it in time) tries again


class Shared:
    """This process's clients and what they have seen between them."""

    def __init__(self) -> None:
        self.clients: list[Client] = []
        self.replies = 0
        self.expected = 0
        self.all_replied = asyncio.Event()
        self.finished = 0
        self.wait_finished = 0
        self.all_finished = asyncio.Event()
        self.shown = 0
        self.all_shown = asyncio.Event()
        self.frames = 0
        self.retries = 0
        self.synced = 0
        self.all_synced = asyncio.Event()


class Client(WSListener):
    def __init__(self, shared: Shared, echo: bool) -> None:
        self.shared = shared
        self.echo = echo
        self.transport: WSTransport | None = None
        self.ready = asyncio.get_running_loop().create_future()
        self.sync_pending = False
        self.sent_at = 0.0
        self.replied_at = 0.0
        self.outcome = ""
        self.seen_finished = False
        self.seen_packet = False

    def on_ws_connected(self, transport: WSTransport) -> None:
        self.transport = transport
        if self.echo:
            self.ready.set_result(None)

    def on_ws_disconnected(self, transport: WSTransport) -> None:
        if not self.ready.done():  # closed before its welcome: the connect fails, and is tried again
            self.ready.set_exception(ConnectionError("closed before the welcome"))

    def on_ws_frame(self, transport: WSTransport, frame: WSFrame) -> None:
        if frame.msg_type != WSMsgType.BINARY:
            return
        data = frame.get_payload_as_bytes()
        shared = self.shared
        shared.frames += 1
        if self.echo or data[6:12] == b"\xa5reply":
            self._reply(data)
        elif data[6:14] == b"\xa7welcome":
            if not self.ready.done():
                self.ready.set_result(None)
        elif b"\xa6packet\xa4data" in data and not self.seen_packet:
            self.seen_packet = True
            shared.shown += 1
            if shared.shown == len(shared.clients):
                shared.all_shown.set()
        elif b"\xa8finished" in data and not self.seen_finished:
            self.seen_finished = True
            shared.finished += 1
            if shared.finished == shared.wait_finished:
                shared.all_finished.set()

    def _reply(self, data: bytes) -> None:
        shared = self.shared
        if self.sync_pending:  # the sync's reply: this client is live in the room
            self.sync_pending = False
            shared.synced += 1
            if shared.synced == len(shared.clients):
                shared.all_synced.set()
            return
        self.replied_at = time.monotonic()
        reply: Any = msgpack.unpackb(data) if not self.echo else {"ok": True, "data": {"outcome": "echo"}}
        self.outcome = reply["data"]["outcome"] if reply["ok"] else reply["error"]["code"]
        shared.replies += 1
        if shared.replies == shared.expected:
            shared.all_replied.set()


async def _connect(shared: Shared, url: str, echo: bool, window: asyncio.Semaphore) -> Client:
    """One client, connected and welcomed; a socket the server refuses before its welcome (as a hub does
    one it cannot welcome within its handshake bound) is tried again, after a pause, as a client would."""
    for attempt in range(1, TRIES + 1):
        client: Client | None = None
        try:
            async with window:
                _, listener = await ws_connect(
                    lambda: Client(shared, echo), url, websocket_handshake_timeout=120
                )
                client = cast(Client, listener)
                await asyncio.wait_for(client.ready, 120)
                return client
        except (ConnectionError, OSError, TimeoutError):
            if client is not None and client.transport is not None:
                client.transport.disconnect()  # (not welcomed in time: it holds no place meanwhile)
            if attempt == TRIES:
                raise
            shared.retries += 1
        await asyncio.sleep(0.2 * attempt)  # (outside the window: the others go on meanwhile)
    raise AssertionError("unreachable")


async def connect(shared: Shared, command: dict[str, Any]) -> dict[str, Any]:
    """Connect this process's clients: to a bare echo (``tokens`` is a count) or to the hub (a token
    each)."""
    shared.clients.clear()
    echo = isinstance(command["tokens"], int)
    targets = (
        [command["url"]] * command["tokens"]
        if echo
        else [f"{command['url']}?token={t}" for t in command["tokens"]]
    )
    cpu, began = time.process_time(), time.monotonic()
    shared.retries = 0
    window = asyncio.Semaphore(command.get("window", WINDOW))
    shared.clients.extend(await asyncio.gather(*(_connect(shared, u, echo, window) for u in targets)))
    gc.collect()
    gc.freeze()
    done = time.monotonic()
    return {"began": began, "done": done, "cpu": time.process_time() - cpu, "retries": shared.retries}


async def sync(shared: Shared, command: dict[str, Any]) -> dict[str, Any]:
    """Every client syncs the group: from then on it receives the room's events."""
    frame = msgpack.packb({"id": 0, "type": "sync", "groups": {str(command["group"]): None}})
    shared.synced = 0
    cpu, began = time.process_time(), time.monotonic()
    for c in shared.clients:
        c.sync_pending = True
        assert c.transport is not None
        c.transport.send(WSMsgType.BINARY, frame)
    await asyncio.wait_for(shared.all_synced.wait(), 300)
    return {"began": began, "done": time.monotonic(), "cpu": time.process_time() - cpu}


async def await_packet(shared: Shared, command: dict[str, Any]) -> dict[str, Any]:
    await asyncio.wait_for(shared.all_shown.wait(), 120)
    return {"shown": shared.shown}


async def burst(shared: Shared, command: dict[str, Any]) -> dict[str, Any]:
    """Every client sends the frame at once; each one's latency and outcome."""
    frame = bytes.fromhex(command["frame"])
    clients = shared.clients
    shared.replies, shared.expected, shared.frames = 0, len(clients), 0
    shared.all_replied.clear()
    shared.wait_finished = len(clients) if command["wait_finished"] else 0
    gc.disable()
    cpu, went = time.process_time(), time.monotonic()
    for c in clients:
        c.sent_at = time.monotonic()
        assert c.transport is not None
        c.transport.send(WSMsgType.BINARY, frame)
    await asyncio.wait_for(shared.all_replied.wait(), 300)
    if command["wait_finished"]:
        await asyncio.wait_for(shared.all_finished.wait(), 300)
    used = time.process_time() - cpu
    gc.enable()
    outcomes: dict[str, int] = {}
    for c in clients:
        outcomes[c.outcome] = outcomes.get(c.outcome, 0) + 1
    return {
        "went": went,
        "last_reply": max(c.replied_at for c in clients),
        "latencies_ms": [round((c.replied_at - c.sent_at) * 1000, 2) for c in clients],
        "replied_at": [c.replied_at for c in clients],
        "outcomes": outcomes,
        "cpu": used,
        "frames": shared.frames,
        "finished": shared.finished,
    }


async def close(shared: Shared, command: dict[str, Any]) -> dict[str, Any]:
    for c in shared.clients:
        if c.transport is not None:
            c.transport.disconnect()
    shared.clients.clear()
    shared.finished = shared.shown = shared.synced = 0
    shared.all_finished.clear()
    shared.all_synced.clear()
    shared.all_shown.clear()
    gc.unfreeze()
    return {"closed": True}


COMMANDS = {"connect": connect, "sync": sync, "await_packet": await_packet, "burst": burst, "close": close}


async def serve_commands() -> None:
    """Answer the driver's commands until it closes our stdin."""
    shared = Shared()
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=2**28)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        command = json.loads(line)
        handler = COMMANDS.get(command["cmd"])
        if handler is not None:
            sys.stdout.write(json.dumps(await handler(shared, command)) + "\n")
            sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    uvloop.run(serve_commands())
