"""``server.hub.subscriber`` in-process, against a fake of sharded pub/sub: channels owned by masters that
the test moves (a slot migration, a failover), kills and brings back. What is checked is what the hub
sees: the messages delivered, where each channel is subscribed, and ``on_resubscribed`` after every gap.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, cast

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from server.hub.subscriber import Subscriber
from server.store.redisnodes import RedisNodes
from tests.unit.fakes import until

A, B, C = "10.0.0.1:7000", "10.0.0.2:7000", "10.0.0.3:7000"


def said(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """What the subscriber logged: only its own lines (a client another test left reconnecting in this
    process logs too, and caplog hears every logger)."""
    return [r for r in caplog.records if r.name == "server.hub.subscriber"]


class FakeConnection:
    """A subscriber's connection to one fake master (what ``RedisNodes.connect_dedicated`` makes)."""

    def __init__(self, host: str, port: int, shards: FakeShards) -> None:
        self.address = f"{host}:{port}"
        self.shards = shards
        self.inbox: asyncio.Queue[Any] = asyncio.Queue()
        self.subscribed: set[bytes] = set()

    async def connect(self) -> None:
        self.shards.connects[self.address] = self.shards.connects.get(self.address, 0) + 1
        if self.address in self.shards.down:
            raise RedisConnectionError(f"Error 111 connecting to {self.address}. Connection refused.")
        self.shards.open.add(self)

    async def send_command(self, *args: Any) -> None:
        if self not in self.shards.open:
            raise RedisConnectionError("Connection closed by server.")
        name, *rest = args
        self.shards.sent.append((self.address, name, *rest))
        if name == "SSUBSCRIBE":
            self.subscribed.add(rest[0])
            self.inbox.put_nowait([b"ssubscribe", rest[0], len(self.subscribed)])
        elif name == "SUNSUBSCRIBE":
            self.subscribed.discard(rest[0])
            self.inbox.put_nowait([b"sunsubscribe", rest[0], len(self.subscribed)])
        elif name == "PING":
            self.inbox.put_nowait([b"pong", b""])

    async def read_response(self) -> Any:
        reply = await self.inbox.get()
        if isinstance(reply, Exception):
            raise reply
        return reply

    async def disconnect(self) -> None:
        self.shards.open.discard(self)


class FakeShards:
    """Which master owns each channel's slot, and the connections open to each."""

    def __init__(self, owners: dict[bytes, str]) -> None:
        self.owners = owners  # what a reading of the slot map says now
        self.down: set[str] = set()
        self.open: set[FakeConnection] = set()
        self.connects: dict[str, int] = {}
        self.sent: list[tuple[Any, ...]] = []

    def publish(self, channel: bytes, data: bytes) -> None:
        """``SPUBLISH`` on the channel's master: every connection there subscribed to it hears it."""
        for conn in self.open:
            if conn.address == self.owners[channel] and channel in conn.subscribed:
                conn.inbox.put_nowait([b"smessage", channel, data])

    def move(self, channel: bytes, to: str) -> None:
        """The channel's slot migrates: its old master unsubscribes its subscribers, unasked."""
        self.owners[channel] = to
        for conn in list(self.open):
            if channel in conn.subscribed and conn.address != to:
                conn.subscribed.discard(channel)
                conn.inbox.put_nowait([b"sunsubscribe", channel, len(conn.subscribed)])

    def kill(self, address: str) -> None:
        self.down.add(address)
        for conn in list(self.open):
            if conn.address == address:
                self.open.discard(conn)
                conn.inbox.put_nowait(RedisConnectionError("Connection closed by server."))

    def subscriptions(self) -> dict[str, set[bytes]]:
        out: dict[str, set[bytes]] = {}
        for conn in self.open:
            out.setdefault(conn.address, set()).update(conn.subscribed)
        return {address: names for address, names in out.items() if names}


class FakeNodes:
    """What ``Subscriber`` asks of ``RedisNodes``: where a channel's master is, and the slot map read again
    (``refresh``; ``unreadable`` makes it fail)."""

    address = staticmethod(RedisNodes.address)

    def __init__(self, shards: FakeShards) -> None:
        self.shards = shards
        self.seen = dict(shards.owners)  # the slot map as last read
        self.refreshes = 0
        self.unreadable = False

    def dedicated(self, key: bytes) -> dict[str, Any]:
        host, _, port = self.seen[key].rpartition(":")
        return {"connection_class": FakeConnection, "host": host, "port": int(port), "shards": self.shards}

    async def refresh(self) -> None:
        self.refreshes += 1
        if self.unreadable:
            raise RedisConnectionError("Error 111 reading the slot map")
        self.seen = dict(self.shards.owners)


class Hub:
    """What the hub gives a subscriber: where messages go, and the gap filler."""

    def __init__(self) -> None:
        self.messages: list[tuple[bytes, bytes]] = []
        self.fills = 0

    def on_message(self, channel: bytes, data: bytes) -> None:
        self.messages.append((channel, data))

    async def on_resubscribed(self) -> None:
        self.fills += 1


def channel(n: int) -> bytes:
    return f"rp:{{s{n}}}:g{n}:ch".encode()


ONE, TWO, THREE = channel(1), channel(2), channel(3)


async def subscribed(owners: dict[bytes, str], first: list[bytes]) -> tuple[Subscriber, FakeShards, Hub]:
    shards = FakeShards(owners)
    hub = Hub()
    sub = Subscriber(cast(RedisNodes, FakeNodes(shards)), hub.on_message, hub.on_resubscribed)
    await sub.start([c.decode() for c in first])
    return sub, shards, hub


async def heard(hub: Hub, shards: FakeShards, name: bytes, data: bytes) -> None:
    """Publish on ``name`` and wait (bounded) until the hub got it."""
    shards.publish(name, data)
    await until(lambda: (name, data) in hub.messages)


async def test_each_channel_is_subscribed_on_its_own_master_and_its_messages_delivered_in_order() -> None:
    sub, shards, hub = await subscribed({ONE: A, TWO: B, THREE: A}, [ONE, TWO])
    try:
        assert shards.subscriptions() == {A: {ONE}, B: {TWO}}
        await sub.add(THREE.decode())  # on a master already linked: subscribed on that connection
        await sub.add(THREE.decode())  # wanted twice: subscribed once
        await until(lambda: shards.subscriptions() == {A: {ONE, THREE}, B: {TWO}})
        assert [s for s in shards.sent if s[1] == "SSUBSCRIBE" and s[2] == THREE] == [
            (A, "SSUBSCRIBE", THREE)
        ]
        for i in range(3):
            shards.publish(ONE, b"one-%d" % i)
            shards.publish(TWO, b"two-%d" % i)
        shards.publish(THREE, b"three")
        await until(lambda: len(hub.messages) == 7)
        assert [d for c, d in hub.messages if c == ONE] == [b"one-0", b"one-1", b"one-2"]
        assert [d for c, d in hub.messages if c == TWO] == [b"two-0", b"two-1", b"two-2"]
        assert sub.reconnects == 0 and hub.fills == 0
    finally:
        await sub.close()
    assert shards.open == set()  # every connection released


async def test_a_channel_on_a_master_not_yet_linked_opens_a_link_to_it() -> None:
    sub, shards, hub = await subscribed({ONE: A, TWO: C}, [ONE])
    try:
        await sub.add(TWO.decode())
        await until(lambda: shards.subscriptions() == {A: {ONE}, C: {TWO}})
        await heard(hub, shards, TWO, b"hello")
        assert sub.reconnects == 0
    finally:
        await sub.close()


async def test_a_channel_left_is_unsubscribed_and_its_reply_is_not_taken_for_a_moved_slot(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="server.hub.subscriber")
    sub, shards, hub = await subscribed({ONE: A, TWO: A}, [ONE, TWO])
    try:
        await sub.remove(TWO.decode())
        await until(lambda: shards.subscriptions() == {A: {ONE}})
        # Left and wanted again before the reply to the unsubscribe is read (a member reconnecting).
        for _ in range(5):
            await sub.remove(ONE.decode())
            await sub.add(ONE.decode())
        await heard(hub, shards, ONE, b"still here")  # the replies came before it, and were ours
        assert shards.subscriptions() == {A: {ONE}}
        assert sub.reconnects == 0 and not [r for r in said(caplog) if "slot moved" in r.getMessage()]
        shards.publish(TWO, b"not wanted")
        await heard(hub, shards, ONE, b"after")
        assert (TWO, b"not wanted") not in hub.messages
    finally:
        await sub.close()


async def test_a_moved_slot_moves_its_channel_to_the_new_master_and_the_gap_is_filled(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="server.hub.subscriber")
    sub, shards, hub = await subscribed({ONE: A, TWO: A}, [ONE, TWO])
    try:
        shards.move(TWO, B)  # a migration: A says "sunsubscribe" unasked
        await until(lambda: shards.subscriptions() == {A: {ONE}, B: {TWO}} and hub.fills == 1)
        assert sub.reconnects == 1
        assert ["slot moved" in r.getMessage() for r in said(caplog)] == [True]
        await heard(hub, shards, TWO, b"from its new master")
        await heard(hub, shards, ONE, b"and the rest as before")
    finally:
        await sub.close()


async def test_a_master_lost_and_failed_over_is_resubscribed_on_its_replacement(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="server.hub.subscriber")
    sub, shards, hub = await subscribed({ONE: A, TWO: B}, [ONE, TWO])
    try:
        shards.owners[ONE] = C  # its replica at C is promoted as A dies
        shards.kill(A)
        await until(lambda: shards.subscriptions() == {B: {TWO}, C: {ONE}} and hub.fills == 1)
        assert [r.getMessage() for r in said(caplog)] == [
            f"sharded pub/sub to {A} lost: Connection closed by server.; reconnecting"
        ]
        await heard(hub, shards, ONE, b"after the failover")
        await heard(hub, shards, TWO, b"the other master never left")
    finally:
        await sub.close()


async def test_a_master_that_stays_down_is_retried_and_said_once_until_it_is_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="server.hub.subscriber")
    sub, shards, hub = await subscribed({ONE: A}, [ONE])
    nodes = cast(FakeNodes, sub.nodes)
    try:
        nodes.unreadable = True  # the slot map cannot be read either, for a while
        shards.kill(A)
        await until(lambda: nodes.refreshes >= 2)
        nodes.unreadable = False
        await until(lambda: shards.connects[A] >= 4)  # tried again and again
        assert hub.fills == 0  # nothing to fill from while nothing is subscribed
        shards.down.clear()
        await until(lambda: shards.subscriptions() == {A: {ONE}} and hub.fills >= 1)
        lost = [r for r in said(caplog) if "lost" in r.getMessage()]
        unreadable = [r for r in said(caplog) if "cannot read the slot map" in r.getMessage()]
        assert len(lost) == 1 and len(unreadable) >= 1  # the loss said once, not at every retry
        await heard(hub, shards, ONE, b"back")
    finally:
        await sub.close()


async def test_replies_that_are_no_message_are_ignored() -> None:
    sub, shards, hub = await subscribed({ONE: A}, [ONE])
    try:
        (conn,) = shards.open
        for junk in (b"PONG", [], [b"pong", b""], [b"smessage", ONE], [b"sunsubscribe", TWO, 0], 7):
            conn.inbox.put_nowait(junk)
        await heard(hub, shards, ONE, b"after the junk")
        assert hub.messages == [(ONE, b"after the junk")] and sub.reconnects == 0
    finally:
        await sub.close()
