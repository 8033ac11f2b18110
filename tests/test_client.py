"""The Python client (``redpacket_client.reconnecting.RedPacketClient``) against real hubs: it reconnects when
the hub goes away and comes back on the same port, and gets what it missed once; what the hub can no
longer replay comes as a ``reset``; a token refresh is called and used; requests time out and fail when
the connection drops; a bad token stops it. Drops are real: a hub stopped and started again, a TCP proxy
that cuts every connection, or the hub closing the socket with a code of its own."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import pytest

from redpacket_client.connection import HubClient, HubError
from redpacket_client.reconnecting import Backoff, RedPacketClient
from server.hub.tokens import make_token
from server.ids import GroupId, UserId
from server.settings import Settings
from tests.hubtools import HubUnderTest, eventually, hub_in_process, make_room, server_port

FAST = Backoff(initial=0.05, maximum=0.2)


class Proxy:
    """TCP in front of a hub. ``hold()`` stops passing the hub's bytes on (no reply comes), ``cut()``
    drops every connection at once (the client's socket ends without a close frame: 1006),
    ``refusing`` closes new connections as they come."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.flowing = asyncio.Event()
        self.flowing.set()
        self.refusing = False
        self.accepted = 0
        self.sent = 0  # bytes from clients to the hub
        self.writers: list[asyncio.StreamWriter] = []
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> Proxy:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        self.flowing.set()
        self.cut()
        await self.server.wait_closed()

    def ws(self) -> str:
        assert self.server is not None
        return f"ws://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/ws"

    def hold(self) -> None:
        self.flowing.clear()

    def cut(self) -> None:
        for w in self.writers:
            w.transport.abort()
        self.writers.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        if self.refusing:
            writer.transport.abort()
            return
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        self.writers += [writer, up_writer]
        await asyncio.gather(
            self._pipe(reader, up_writer, False), self._pipe(up_reader, writer, True), return_exceptions=True
        )
        writer.transport.abort()
        up_writer.transport.abort()

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, from_hub: bool) -> None:
        while data := await src.read(65536):
            if from_hub:
                await self.flowing.wait()
            else:
                self.sent += len(data)
            dst.write(data)
            await dst.drain()
        if dst.can_write_eof():  # an end passed on as an end: each side sees the other close
            dst.write_eof()


async def chats(c: RedPacketClient, until: str) -> list[str]:
    """The chat texts ``c`` delivers up to and including ``until`` (other messages skipped)."""
    texts: list[str] = []
    while not texts or texts[-1] != until:
        message = await c.next_event(timeout=30)
        assert message["type"] != "closed", message
        if message["type"] == "event" and message["event"] == "chat":
            texts.append(message["data"]["text"])
    return texts


async def next_of(c: RedPacketClient, kind: str) -> dict[str, Any]:
    while True:
        message = await c.next_event(timeout=30)
        if message["type"] == kind:
            return message


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
async def test_reconnects_when_the_hub_comes_back_and_delivers_what_it_missed_once(
    hub_settings: Settings, h: HubUnderTest, fmt: str
) -> None:
    room = await make_room(h, 1)
    admin = await h.client(room.admin_token)  # on a hub that stays up
    port = server_port()
    async with hub_in_process(hub_settings, port=port) as away:
        c = await RedPacketClient.connect(away.ws, room.members[0][1], fmt=fmt, backoff=FAST)
        await c.sync()
        await admin.request("chat", group=room.group, text="before")
        assert await chats(c, "before") == ["before"]
    # The hub is gone (its port refuses): the client keeps trying while the room goes on without it.
    await eventually(lambda: not c.connected)
    for i in range(3):
        await admin.request("chat", group=room.group, text=f"away {i}")
    async with hub_in_process(hub_settings, port=port):
        await c.wait_connected(timeout=30)
        await admin.request("chat", group=room.group, text="after")
        # Re-synced on its own from the last offset: each missed chat once, nothing seen before again.
        assert await chats(c, "after") == ["away 0", "away 1", "away 2", "after"]
        assert c.connections == 2 and c.closed is None
        await c.close()
    await admin.close()


async def test_a_hub_close_is_retried_by_code_and_a_gap_is_synced(h: HubUnderTest) -> None:
    room = await make_room(h, 1)
    admin = await h.client(room.admin_token)
    c = await RedPacketClient.connect(h.ws, room.members[0][1], backoff=FAST)
    await c.sync()
    for code in (1012, 1013, 4008):  # restarting, try again, too slow: each reconnects and re-syncs
        for conn in list(h.hub.by_user[UserId(room.members[0][0])]):
            conn.close(code, "closed by the test")
        await eventually(lambda n=c.connections: c.connections > n and c.connected)  # type: ignore[misc]
        await admin.request("chat", group=room.group, text=f"after {code}")
        assert await chats(c, f"after {code}") == [f"after {code}"]
    assert c.connections == 4
    # The hub loses events for this socket (held, never sent), then says so: the client syncs the group
    # from its last offset and gets them once.
    (conn,) = [x for x in h.hub.by_user[UserId(room.members[0][0])] if not x.closing]
    assert conn.hold(GroupId(room.group))
    for i in range(2):
        await admin.request("chat", group=room.group, text=f"lost {i}")
    conn.send({"type": "gap", "group": GroupId(room.group)})
    await admin.request("chat", group=room.group, text="later")
    assert await chats(c, "later") == ["lost 0", "lost 1", "later"]
    await c.close()
    await admin.close()


async def test_what_the_hub_can_no_longer_replay_comes_as_a_reset(hub_settings: Settings) -> None:
    async with hub_in_process(hub_settings.replace(sync_limit=3)) as h, Proxy(_port(h)) as proxy:
        room = await make_room(h, 1)
        admin = await h.client(room.admin_token)
        c = await RedPacketClient.connect(proxy.ws(), room.members[0][1], backoff=FAST)
        await c.sync()
        sent = await admin.request("send", group=room.group, total=500, count=2, request_id="r1")
        while (await next_of(c, "event"))["event"] != "packet":
            pass
        proxy.refusing = True
        proxy.cut()
        await eventually(lambda: not c.connected)
        for i in range(5):  # more than the hub replays (sync_limit)
            await admin.request("chat", group=room.group, text=f"away {i}")
        proxy.refusing = False
        reset = await next_of(c, "reset")
        assert reset["group"] == room.group
        assert [p["packet_id"] for p in reset["packets"]] == [sent["packet_id"]]
        await admin.request("chat", group=room.group, text="after")
        assert await chats(c, "after") == ["after"]  # reloaded from the reset, not replayed
        await c.close()
        await admin.close()


async def test_the_token_refresh_is_called_on_every_reconnect_and_its_token_used(h: HubUnderTest) -> None:
    room = await make_room(h, 1)
    secret = h.settings.secret.encode()
    expired = make_token(secret, room.members[0][0], 1_000, 10)
    given: list[str] = []

    async def refresh() -> str:
        given.append(make_token(secret, room.members[0][0], int(time.time()), 600, jti=str(len(given))))
        return given[-1]

    async with Proxy(_port(h)) as proxy:
        # An expired token: the hub closes 4001 token_expired, the client asks for a fresh one and connects.
        c = await RedPacketClient.connect(proxy.ws(), expired, refresh_token=refresh, backoff=FAST)
        assert len(given) == 1 and c.token == given[0] and c.connections == 1
        proxy.cut()
        await eventually(lambda: c.connections == 2 and c.connected)
        assert len(given) == 2 and c.token == given[1]
        assert (await c.request("ping"))["ts"] > 0
        await c.close()
    # A plain function works too, and is called for the first token when none is given.
    c = await RedPacketClient.connect(h.ws, None, refresh_token=lambda: room.members[0][1], backoff=FAST)
    assert c.welcome["user"] == room.members[0][0]
    await c.close()


async def test_requests_time_out_and_fail_when_the_connection_drops(h: HubUnderTest) -> None:
    room = await make_room(h, 1)
    async with Proxy(_port(h)) as proxy:
        c = await RedPacketClient.connect(proxy.ws(), room.members[0][1], backoff=FAST)
        proxy.hold()  # the hub answers, but nothing reaches the client
        with pytest.raises(HubError) as e:
            await c.request("ping", timeout=0.5)
        assert e.value.code == "timeout"
        before = proxy.sent
        pending = asyncio.create_task(c.request("ping", timeout=60))
        await eventually(lambda: proxy.sent > before)  # on its way
        proxy.flowing.set()
        proxy.cut()
        with pytest.raises(HubError) as e:
            await asyncio.wait_for(pending, 10)  # at once, not after its 60 s
        assert e.value.code == "disconnected"
        await c.wait_connected(timeout=30)
        assert (await c.request("ping"))["ts"] > 0
        await c.close()
        with pytest.raises(HubError) as e:
            await c.request("ping")
        assert e.value.code == "closed"
    # The single connection fails its waiting requests as soon as it ends, too.
    one = await HubClient.connect(h.ws, room.members[0][1])
    waiting = asyncio.create_task(one.request("ping", timeout=60))
    await one.close()
    with pytest.raises(Exception) as gone:
        await asyncio.wait_for(waiting, 10)
    assert not isinstance(gone.value, TimeoutError)


async def test_a_bad_token_is_not_retried(h: HubUnderTest) -> None:
    room = await make_room(h, 1)
    calls = []

    def refresh() -> str:
        calls.append(1)
        return "garbage"

    with pytest.raises(HubError) as e:
        await RedPacketClient.connect(h.ws, "garbage", refresh_token=refresh, backoff=FAST)
    assert e.value.code == "token_invalid" and calls == []
    async with Proxy(_port(h)) as proxy:
        c = await RedPacketClient.connect(proxy.ws(), room.members[0][1], refresh_token=refresh, backoff=FAST)
        proxy.cut()
        closed = await next_of(c, "closed")
        assert closed["code"] == "token_invalid" and c.closed is not None
        assert calls == [1] and proxy.accepted == 2 and not c.connected
        with pytest.raises(HubError) as e:
            await c.request("ping")
        assert e.value.code == "token_invalid"
        await c.close()


async def test_it_gives_up_after_the_attempts_it_was_given() -> None:
    with socket.socket() as s:  # a port nothing listens on: every attempt is refused
        s.bind(("127.0.0.1", 0))
        nowhere = f"ws://127.0.0.1:{s.getsockname()[1]}/ws"
        with pytest.raises(HubError) as e:
            await RedPacketClient.connect(nowhere, "any", backoff=Backoff(initial=0.01, attempts=3))
    assert e.value.code == "unreachable" and "after 3 attempts" in e.value.message


def _port(h: HubUnderTest) -> int:
    return int(h.http.rsplit(":", 1)[1])
