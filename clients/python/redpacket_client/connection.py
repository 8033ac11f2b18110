"""One connection to a hub, speaking its websocket protocol (used by the tests and the benchmarks; an app
wants ``redpacket_client.RedPacketClient``, which reconnects and recovers on top of it).

    async with await HubClient.connect("ws://127.0.0.1:8000/ws", token) as c:
        await c.sync()                         # start receiving the groups' events
        data = await c.request("grab", group=1, packet=7)
        event = await c.next_event()

Events of a group are delivered in offset order, each once: the client drops any offset it has already
seen (a replay after a reconnect can overlap the live stream). When the connection ends, requests still
waiting for their reply fail at once (``ConnectionClosed``; ``HubError("disconnected")`` if reading
ended otherwise: a frame that could not be decoded, the reader cancelled).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import Callable
from typing import Any

import msgpack
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed
from websockets.typing import Subprotocol

from redpacket_client.protocol import (
    SUBPROTOCOL_JSON,
    SUBPROTOCOL_MSGPACK,
    TOKEN_SUBPROTOCOL,
    Format,
    offset_key,
)


class HubError(Exception):
    """An error reply: ``code`` is the protocol's stable code (docs/protocol.md, "Error codes"),
    ``message`` its words for a person, ``details`` the facts a client words its own message with
    (``limit``, ``retry_after_ms``…). Also ``disconnected`` and ``timeout``, said by the client."""

    def __init__(self, code: str, message: str = "", **details: Any) -> None:
        super().__init__(message or code)
        self.code = code
        self.message = message or code
        self.details = details

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.code!r}, {self.message!r})"


class HubClient:
    def __init__(
        self,
        ws: ClientConnection,
        fmt: Format,
        on_event: Callable[[dict[str, Any]], None] | None = None,
        *,
        on_notice: Callable[[dict[str, Any]], None] | None = None,
        offsets: dict[int, str] | None = None,
    ) -> None:
        self.ws = ws
        self.fmt: Format = fmt
        # Called with each new event instead of queueing it (a bench that must not keep them all).
        self.on_event = on_event
        # Likewise for every other message (welcome, notices, replies nobody waits for).
        self.on_notice = on_notice
        self.welcome: dict[str, Any] = {}
        # The last offset seen per group; a reconnecting client hands every connection the same dict.
        self.offsets: dict[int, str] = {} if offsets is None else offsets
        self.events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.notices: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._ids = itertools.count(1)
        self._waiting: dict[int | str, asyncio.Future[dict[str, Any]]] = {}
        self._welcomed = asyncio.Event()
        self._reader: asyncio.Task[None] | None = None
        self.closed: ConnectionClosed | None = None

    @classmethod
    async def connect(
        cls,
        url: str,
        token: str,
        fmt: Format = "msgpack",
        device: str | None = None,
        on_event: Callable[[dict[str, Any]], None] | None = None,
        *,
        on_notice: Callable[[dict[str, Any]], None] | None = None,
        offsets: dict[int, str] | None = None,
        welcome_timeout: float = 30,
        **options: Any,
    ) -> HubClient:
        """Open a socket; ``device`` identifies the client device to the bot detector. The token goes as
        a ``bearer.`` subprotocol, out of the URL (docs/protocol.md, "Connecting"). Refused before the
        welcome: raises the ``ConnectionClosed`` (its ``rcvd`` holds the close code and reason)."""
        sub = SUBPROTOCOL_MSGPACK if fmt == "msgpack" else SUBPROTOCOL_JSON
        query = f"?device={device}" if device else ""
        offered = [Subprotocol(sub), Subprotocol(TOKEN_SUBPROTOCOL + token)]
        ws = await connect(f"{url}{query}", subprotocols=offered, compression=None, **options)
        client = cls(ws, fmt, on_event, on_notice=on_notice, offsets=offsets)
        client._reader = asyncio.create_task(client._read())
        welcomed = asyncio.create_task(client._welcomed.wait())
        # A bound, not a wait: the welcome comes at once unless the hub (or the machine) is swamped.
        await asyncio.wait(
            {welcomed, client._reader}, timeout=welcome_timeout, return_when=asyncio.FIRST_COMPLETED
        )
        welcomed.cancel()
        if not client._welcomed.is_set():
            # Refused (bad token: close 4001) or nothing arrived in time.
            await client.close()
            if client.closed is not None:
                raise client.closed
            raise TimeoutError("no welcome from the hub")
        return client

    async def __aenter__(self) -> HubClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.ws.close()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader

    @property
    def groups(self) -> list[int]:
        return [int(g["group_id"]) for g in self.welcome.get("groups", [])]

    def encode(self, message: dict[str, Any]) -> bytes | str:
        if self.fmt == "msgpack":
            return msgpack.packb(message, use_bin_type=True)
        return json.dumps(message)

    async def send_raw(self, frame: bytes | str) -> None:
        await self.ws.send(frame)

    async def request(self, kind: str, /, timeout: float | None = 30, **fields: Any) -> dict[str, Any]:
        """Send one request; return its reply's data or raise ``HubError`` with the reply's code."""
        if self._reader is not None and self._reader.done():
            raise self.closed or HubError("disconnected", "the connection is closed")
        rid = next(self._ids)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[rid] = fut
        try:
            await self.ws.send(self.encode({"id": rid, "type": kind, **fields}))
            reply = await asyncio.wait_for(fut, timeout)
        finally:
            self._waiting.pop(rid, None)
        if not reply["ok"]:
            error = dict(reply["error"])
            raise HubError(error.pop("code"), error.pop("message"), **error)
        return dict(reply["data"])

    async def sync(self, groups: list[int] | None = None) -> dict[str, Any]:
        """Ask for what was missed since the last offsets seen (or the current state), group by group."""
        wanted = {str(g): self.offsets.get(g) for g in (self.groups if groups is None else groups)}
        return await self.request("sync", groups=wanted)

    async def next_event(self, timeout: float = 30) -> dict[str, Any]:
        return await asyncio.wait_for(self.events.get(), timeout)

    async def next_notice(self, timeout: float = 30) -> dict[str, Any]:
        return await asyncio.wait_for(self.notices.get(), timeout)

    async def wait_done(self) -> None:
        """Return once the connection has ended."""
        if self._reader is not None:
            await asyncio.wait({self._reader})

    async def _read(self) -> None:
        try:
            await self._read_frames()
        except ConnectionClosed as e:
            self.closed = e
        finally:
            # Whatever ended the reading (a close, close(), a frame that could not be read), nobody
            # waits for a reply that cannot come.
            gone = self.closed or HubError("disconnected", "the connection ended")
            for fut in self._waiting.values():
                if not fut.done():
                    fut.set_exception(gone)

    async def _read_frames(self) -> None:
        async for frame in self.ws:
            message = msgpack.unpackb(frame, raw=False) if isinstance(frame, bytes) else json.loads(frame)
            kind = message.get("type")
            if kind == "reply" and message.get("id") in self._waiting:
                fut = self._waiting[message["id"]]
                if not fut.done():
                    fut.set_result(message)
            elif kind == "event":
                group = int(message["group"])
                seen = self.offsets.get(group)
                if seen is None or offset_key(message["offset"]) > offset_key(seen):
                    self.offsets[group] = message["offset"]
                    if self.on_event is None:
                        self.events.put_nowait(message)
                    else:
                        self.on_event(message)
            else:  # welcome, removed, added, gap, and replies nobody waits for (to unreadable frames)
                if kind == "welcome":
                    self.welcome = message
                    self._welcomed.set()
                if self.on_notice is None:
                    self.notices.put_nowait(message)
                else:
                    self.on_notice(message)
