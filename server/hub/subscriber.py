"""Sharded pub/sub for a hub: one connection per Redis master that owns a wanted channel, kept right
through failovers and slot moves.

Group channels are sharded channels in their group's slot (``SPUBLISH`` from ``lua/publish_event.lua``),
so on a cluster only the master owning that slot carries them. redis-py 5.3's asyncio clients cannot
``SSUBSCRIBE``; this module speaks it on plain connections (``RedisNodes.dedicated``). One *link* per
master address reads its connection in one task; commands are written under a lock.

When a link breaks (the master died, the network dropped, it stopped answering pings) or Redis says a
channel moved (an unrequested ``sunsubscribe`` after a slot migration or failover), the subscriber reads
the slot map again, moves each channel to the master that owns it now, resubscribes, and calls
``on_resubscribed`` so the hub can fill the gap from the group streams. Nothing is lost silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from redis.exceptions import RedisError

from server.stopping import check_cancelled, stop
from server.store.redisconn import Packed
from server.store.redisnodes import RedisNodes

log = logging.getLogger(__name__)

PING_EVERY = 10.0
SILENT_FOR = 30.0


class _Link:
    """One subscription connection to one master, and the channels it carries."""

    def __init__(self, owner: Subscriber, address: str, kwargs: dict[str, Any]) -> None:
        self.owner = owner
        self.address = address
        self.kwargs = kwargs
        self.channels: set[bytes] = set()
        # Unsubscribes sent and not yet confirmed, per channel: their replies are ours, not a moved slot
        # (a channel left and wanted again at once gets the old reply while it is wanted again).
        self.leaving: dict[bytes, int] = {}
        self.conn: Packed | None = None
        self.lock = asyncio.Lock()
        self.up = asyncio.Event()
        self.served = False  # it was up (connected and subscribed) since it was last started
        self.task: asyncio.Task[None] | None = None
        self.heard = time.monotonic()

    async def command(self, *args: Any) -> None:
        """Write a command if connected (a link not yet connected subscribes its channels when it is)."""
        async with self.lock:
            if self.conn is not None:
                await self.conn.send_command(*args)

    async def run(self) -> None:
        """Connect, subscribe every channel, read until the connection fails; the owner then re-routes."""
        conn = RedisNodes.connect_dedicated(self.kwargs)
        try:
            # (redis-py's Connection.connect is not annotated.)
            await conn.connect()  # type: ignore[no-untyped-call]
            async with self.lock:
                self.conn = conn
                self.leaving.clear()  # a new connection: no reply to an old one's unsubscribe will come
                # One channel per command: on a cluster the channels of one command must share a slot.
                for name in sorted(self.channels):
                    await conn.send_command("SSUBSCRIBE", name)
            self.up.set()
            self.served = True
            pinger = asyncio.create_task(self._ping())
            try:
                while True:
                    reply = await conn.read_response()
                    self.heard = time.monotonic()
                    self.owner._reply(self, reply)
            finally:
                pinger.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pinger
        finally:
            self.up.clear()
            self.conn = None
            with contextlib.suppress(Exception):
                await conn.disconnect()

    async def _ping(self) -> None:
        """Subscribed connections get no replies when nothing is published: ping, and drop a connection
        that stays silent (a dead peer that never closed)."""
        while True:
            check_cancelled()
            await asyncio.sleep(PING_EVERY)
            if time.monotonic() - self.heard > SILENT_FOR and self.conn is not None:
                log.warning("sharded pub/sub to %s went silent; reconnecting", self.address)
                await self.conn.disconnect()
                return
            with contextlib.suppress(Exception):
                await self.command("PING")


class Subscriber:
    """Subscribe sharded channels wherever they live; deliver ``(channel, data)`` to ``on_message``."""

    def __init__(
        self,
        nodes: RedisNodes,
        on_message: Callable[[bytes, bytes], None],
        on_resubscribed: Callable[[], Awaitable[None]],
    ) -> None:
        self.nodes = nodes
        self.on_message = on_message
        self.on_resubscribed = on_resubscribed
        self.wanted: set[bytes] = set()
        self.links: dict[str, _Link] = {}
        self._wake = asyncio.Event()
        self._runner: asyncio.Task[None] | None = None
        self._filler: asyncio.Task[None] | None = None
        self.reconnects = 0

    async def start(self, first: list[str]) -> None:
        """Subscribe ``first`` and wait (bounded) until their links are up."""
        for channel in first:
            self._route(channel.encode())
        self._runner = asyncio.create_task(self._supervise())
        await asyncio.wait_for(asyncio.gather(*(link.up.wait() for link in self.links.values())), 10)

    async def close(self) -> None:
        await stop(
            [
                t
                for t in (self._runner, self._filler, *(link.task for link in self.links.values()))
                if t is not None
            ],
            "the hub's pub/sub",
        )

    async def add(self, channel: str) -> None:
        name = channel.encode()
        if name in self.wanted:
            return
        link = self._route(name)
        with contextlib.suppress(RedisError, OSError):  # a broken link subscribes it once it is back
            await link.command("SSUBSCRIBE", name)

    async def remove(self, channel: str) -> None:
        name = channel.encode()
        self.wanted.discard(name)
        for link in self.links.values():
            if name in link.channels:
                link.channels.discard(name)
                link.leaving[name] = link.leaving.get(name, 0) + 1
                with contextlib.suppress(RedisError, OSError):
                    await link.command("SUNSUBSCRIBE", name)

    def _route(self, name: bytes) -> _Link:
        """Put a wanted channel on the link of the master that owns its slot (a new link starts)."""
        self.wanted.add(name)
        kwargs = self.nodes.dedicated(name)
        address = self.nodes.address(kwargs)
        link = self.links.get(address)
        if link is None:
            link = self.links[address] = _Link(self, address, kwargs)
            self._wake.set()
        link.channels.add(name)
        return link

    def _reply(self, link: _Link, reply: Any) -> None:
        if not isinstance(reply, list) or not reply:
            return
        kind = reply[0]
        if kind == b"smessage" and len(reply) == 3:
            self.on_message(reply[1], reply[2])
        elif kind == b"sunsubscribe" and len(reply) >= 2 and link.leaving.get(reply[1]):
            link.leaving[reply[1]] -= 1  # the answer to our own unsubscribe
            if not link.leaving[reply[1]]:
                del link.leaving[reply[1]]
        elif kind == b"sunsubscribe" and len(reply) >= 2 and reply[1] in link.channels:
            # Not asked for: the slot moved (a migration or a failover). Re-route everything.
            log.warning("channel %r left %s (its slot moved); re-routing", reply[1], link.address)
            if link.task is not None:
                link.task.cancel()

    async def _supervise(self) -> None:
        """Keep a link running per master that carries a wanted channel. After a link ends (a broken
        connection, a moved slot), read the slot map again, re-route every channel, restart the links,
        and once they are all up let the hub fill the gap."""
        backoff = 0.05
        while True:
            check_cancelled()
            self._wake.clear()
            for link in self.links.values():
                if link.task is None:
                    link.served = False
                    link.task = asyncio.create_task(link.run())
            tasks = [link.task for link in self.links.values() if link.task is not None]
            wake = asyncio.create_task(self._wake.wait())
            try:
                await asyncio.wait([*tasks, wake], return_when=asyncio.FIRST_COMPLETED)
            finally:
                wake.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await wake
            ended = [link for link in self.links.values() if link.task is not None and link.task.done()]
            if not ended:
                continue
            self.reconnects += 1
            for link in ended:
                task, link.task = link.task, None
                error = task.exception() if task is not None and not task.cancelled() else None
                if link.served:
                    backoff = 0.05  # it was working: a new streak of failures, retried at once
                    if error is not None:  # said once per streak, not at every retry
                        log.warning("sharded pub/sub to %s lost: %s; reconnecting", link.address, error)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)
            try:
                await self.nodes.refresh()
            except (RedisError, OSError) as e:
                log.warning("sharded pub/sub: cannot read the slot map (%s); retrying", e)
                continue
            self._regroup()
            if self._filler is not None:
                self._filler.cancel()
            self._filler = asyncio.create_task(self._fill_when_up())

    def _regroup(self) -> None:
        """Every wanted channel on the link of its slot's master now; links whose channels changed (or
        that carry none any more) are stopped, to be started again with the right ones."""
        routes: dict[str, tuple[dict[str, Any], set[bytes]]] = {}
        for name in self.wanted:
            kwargs = self.nodes.dedicated(name)
            routes.setdefault(self.nodes.address(kwargs), (kwargs, set()))[1].add(name)
        for address, link in list(self.links.items()):
            if address not in routes or routes[address][1] != link.channels:
                if link.task is not None:
                    link.task.cancel()
                del self.links[address]
        for address, (kwargs, names) in routes.items():
            if address not in self.links:
                link = self.links[address] = _Link(self, address, kwargs)
                link.channels = names

    async def _fill_when_up(self) -> None:
        while not all(link.up.is_set() for link in self.links.values()):
            for link in list(self.links.values()):
                await link.up.wait()
        try:
            await self.on_resubscribed()
        except Exception:
            log.exception("filling the gap after a pub/sub reconnect failed")
