"""Announcements: a sent packet to its group exactly once, whatever fails in between; its grabs and its
result as they happen, retried until Redis takes them.

**Packets.**
A send commits the debit and the packet before anything is published (``packets.send_packet``). Then the
packet's ``packet`` event is published with a once-key in the group's slot (``events.Once``), and
``red_packets.announced_ms`` is set. If Redis fails between the commit and the publish, the packet stays
unannounced in the database; it is announced

- at once by the sender's retry with the same ``request_id`` (a replay), or
- by a worker (``announce_pending``, every few seconds) once Redis answers again.

The once-key makes every one of these a no-op after the first success, so two of them racing (a hub that
was merely slow, and the worker) still publish one event. It lives as long as the packet can be grabbed
and settled; a packet the database marks announced is never published again.

**Grabs and results** (``Announcer``, one per hub): a hub announces the grabs it made, coalesced in busy
rooms, and the result of the packets its grabs emptied. A publish that fails (Redis restarting) is
retried with back-off until it goes through, in order per group, each with its own once-key so that a
retry after a lost reply never shows a grab twice. Only a hub that dies (or stops with Redis still
down past its shutdown budget) loses the announcements it still held; the grabs themselves are safe in
Redis and shown by ``open``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from redis.exceptions import RedisError

from server.core import Core
from server.errors import RedPacketError
from server.hub import events, protocol
from server.money import grabs, packets
from server.money.grabs import Grab
from server.money.ledger import now_ms
from server.money.packets import Packet
from server.store.db import Tx

if TYPE_CHECKING:
    from server.hub.hub import Hub

T = TypeVar("T")

log = logging.getLogger(__name__)

# Packets younger than this are left to the hub that sent them; older unannounced ones are the worker's.
WORKER_AFTER_MS = 3_000


def packet_event(p: Packet) -> dict[str, Any]:
    """The ``packet`` event's data (also the send reply, with ``offset`` and ``replay``)."""
    return {
        "packet_id": p.packet_id,
        "sender": p.sender_id,
        "kind": p.kind,
        "total": p.total,
        "count": p.count,
        "greeting": p.greeting,
        "target": p.target_user_id,
        "created_ms": p.created_ms,
        "expires_ms": p.expires_ms,
    }


def _packet_lifetime(core: Core) -> int:
    s = core.settings
    return s.packet_ttl_seconds + s.redis_grace_seconds


def _once(core: Core, p: Packet) -> events.Once:
    return events.Once(f"packet:{p.packet_id}", _packet_lifetime(core))


async def announce_packet(core: Core, p: Packet) -> str | None:
    """Put the packet up in Redis if it is not, publish its event once, and record that in the database.
    Returns the event's offset, or None if Redis could not be reached (the packet is then announced by
    a retry or by the worker). Safe to call any number of times, concurrently too."""
    if p.announced_ms is not None:
        # Announced before: never again, even if Redis forgot the once-key. The offset, if it knows it.
        try:
            return await events.published(core, p.group_id, _once(core, p).name)
        except RedisError:
            return None
    try:
        if not p.published or p.replay:
            await packets.recover_packet(core, p.packet_id)  # idempotent: keeps every grab Redis holds
        offset = await events.publish(core, p.group_id, "packet", packet_event(p), _once(core, p))
    except (RedisError, RedPacketError) as e:
        log.warning("packet %d saved but not announced yet (%s): a retry or the worker will", p.packet_id, e)
        return None

    async def mark(tx: Tx) -> int:
        return await tx.execute(
            "UPDATE red_packets SET announced_ms = %s WHERE id = %s AND announced_ms IS NULL",
            (now_ms(), p.packet_id),
        )

    await core.db.run(mark, idempotent=True)
    return offset


async def announce_pending(core: Core, now: int | None = None, limit: int = 500) -> int:
    """Announce the live packets that were saved but never announced (the worker's sweep); returns how
    many were announced now."""
    now = now_ms() if now is None else now
    rows = await core.db.fetchall(
        "SELECT id FROM red_packets WHERE announced_ms IS NULL AND created_ms <= %s"
        " AND status = 'active' AND expires_ms > %s ORDER BY id LIMIT %s",
        (now - WORKER_AFTER_MS, now, limit),
    )
    done = 0
    for (pid,) in rows:
        p = await packets.load_packet(core, int(pid))
        if p is not None and await announce_packet(core, _unpublished(p)) is not None:
            done += 1
    if done:
        log.warning("announced %d packet(s) that were saved while Redis was unavailable", done)
    return done


def _unpublished(p: Packet) -> Packet:
    """A packet read back from the database: whether Redis holds it is unknown, so it is put up again."""
    return dataclasses.replace(p, published=False)


# A retried grab announcement is recognised by its once-key for this long (its retries come within it).
GRABS_ONCE_SECONDS = 3600


class Announcer:
    """Successful grabs, announced to their group: one event per grab while it is quiet, one event per
    ``grab_coalesce_ms`` per process carrying the grabs of that interval when the room is hot. In a
    big room (more than ``big_room_online`` members online, across hubs) the events come further apart
    and list only the latest grabs (``protocol.grabs_announcement``). A packet emptied here gets its
    ``finished`` event after its grabs. Every publish is retried until it goes through."""

    ONLINE_TTL = 2.0

    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        s = hub.core.settings
        self.base = s.grab_coalesce_ms / 1000
        self.pending: dict[int, list[dict[str, Any]]] = {}
        self.last_sent: dict[int, float] = {}
        self.timers: dict[int, asyncio.TimerHandle] = {}
        # Members online in the room across hubs (presence), read at most every ONLINE_TTL seconds.
        self.online: dict[int, tuple[int, float]] = {}
        # One lock per group with publishes under way: they go out in the order they were made.
        self.locks: dict[int, tuple[asyncio.Lock, int]] = {}
        self.serial = itertools.count(1)
        # Set when the hub stops: retries give up at this monotonic time.
        self.give_up_at: float | None = None

    def _online(self, group: int) -> int:
        local = len(self.hub.by_group.get(group, ()))
        return max(local, self.online.get(group, (0, 0.0))[0])

    def _big(self, group: int) -> bool:
        return self._online(group) > self.hub.core.settings.big_room_online

    def grabbed(self, group: int, packet_id: int, g: Grab, remaining: int) -> None:
        item = {
            "packet_id": packet_id,
            "user": g.user_id,
            "amount": g.amount,
            "seq": g.seq,
            "ms": g.grabbed_ms,
            "remaining": remaining,
        }
        self.pending.setdefault(group, []).append(item)
        if group in self.timers:
            return
        s = self.hub.core.settings
        interval = protocol.announce_interval(
            self.base, self._online(group), s.big_room_online, s.big_room_frames_per_second
        )
        wait = self.last_sent.get(group, 0.0) + interval - time.monotonic()
        if wait <= 0:
            self.hub.spawn(self.flush(group))
        else:
            loop = asyncio.get_running_loop()
            self.timers[group] = loop.call_later(wait, lambda: self.hub.spawn(self.flush(group)))

    async def flush(self, group: int) -> None:
        timer = self.timers.pop(group, None)
        if timer is not None:
            timer.cancel()
        items = self.pending.pop(group, [])
        if not items:
            return
        self.last_sent[group] = time.monotonic()
        listed = self.hub.core.settings.big_room_grabs_listed if self._big(group) else None
        data = protocol.grabs_announcement(items, listed)
        once = events.Once(f"grabs:{self.hub.id}:{next(self.serial)}", GRABS_ONCE_SECONDS)
        await self._deliver(group, "grabs", data, once, len(items))
        _, read_at = self.online.get(group, (0, 0.0))
        if time.monotonic() - read_at > self.ONLINE_TTL:
            try:
                self.online[group] = (await self.hub.online_count(group), time.monotonic())
            except RedisError:
                pass  # the last count stands until the next announcement

    async def finished(self, group: int, packet_id: int, viewer: int) -> None:
        """The packet's last share went (grabbed by ``viewer``): its grabs first, then the result."""
        await self.flush(group)
        data = await self._retrying(
            f"the result of packet {packet_id}", lambda: _result(self, group, packet_id, viewer)
        )
        if data is not None:
            once = events.Once(f"finished:{packet_id}", _packet_lifetime(self.hub.core))
            await self._deliver(group, "finished", data, once, 1)

    async def _deliver(self, group: int, kind: str, data: dict[str, Any], once: events.Once, n: int) -> None:
        lock, users = self.locks.get(group) or (asyncio.Lock(), 0)
        self.locks[group] = (lock, users + 1)
        try:
            async with lock:
                await self._retrying(
                    f"{kind} event ({n}) of group {group}", lambda: self.hub.publish(group, kind, data, once)
                )
        finally:
            lock, users = self.locks[group]
            if users == 1:
                del self.locks[group]
            else:
                self.locks[group] = (lock, users - 1)

    async def _retrying(self, what: str, attempt: Callable[[], Awaitable[T]]) -> T | None:
        """``attempt()`` until it does not fail for want of Redis; None if the hub stopped first."""
        backoff = 0.05
        failures = 0
        while True:
            try:
                return await attempt()
            except RedisError as e:
                failures += 1
                if failures == 1:
                    log.warning("%s not published yet (%s); retrying until Redis takes it", what, e)
                if self.give_up_at is not None and time.monotonic() + backoff > self.give_up_at:
                    log.error("%s lost: the hub stopped while Redis was unavailable", what)
                    return None
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    async def close(self, budget_seconds: float) -> None:
        """Publish what is pending, giving up on Redis after ``budget_seconds``."""
        self.give_up_at = time.monotonic() + budget_seconds
        for group in list(self.pending):
            await self.flush(group)


async def _result(a: Announcer, group: int, packet_id: int, viewer: int) -> dict[str, Any]:
    v = await grabs.open_packet(a.hub.core, packet_id, group, viewer)
    best = v.best_luck
    return {
        "packet_id": packet_id,
        "total": v.total,
        "count": v.count,
        "duration_ms": v.duration_ms,
        "best_luck": None if best is None else {"user": best.user_id, "amount": best.amount},
    }
