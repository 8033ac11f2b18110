"""Announcing grabs and results (``Announcer``, one per hub): a hub announces the grabs it made,
coalesced in busy rooms, and the result of the packets its grabs emptied. A publish that fails (Redis
restarting) is retried with back-off until it goes through, in order per group, each with its own
once-key so that a retry after a lost reply never shows a grab twice. Only a hub that dies (or stops with
Redis still down past its shutdown budget) loses the announcements it still held; the grabs themselves
are safe in Redis and shown by ``open``. Packets are announced by ``server.live.announce``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from redis.exceptions import RedisError

from server.hub import protocol
from server.ids import GroupId, PacketId, UserId
from server.live.announce import packet_lifetime
from server.money import grabs
from server.money.grabs import Grab
from server.store.scriptcalls import Once

if TYPE_CHECKING:
    from server.hub.hub import Hub

T = TypeVar("T")

log = logging.getLogger(__name__)

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
        self.pending: dict[GroupId, list[dict[str, Any]]] = {}
        self.last_sent: dict[GroupId, float] = {}
        self.timers: dict[GroupId, asyncio.TimerHandle] = {}
        # Members online in the room across hubs (presence), read at most every ONLINE_TTL seconds.
        self.online: dict[GroupId, tuple[int, float]] = {}
        # One lock per group with publishes under way: they go out in the order they were made.
        self.locks: dict[GroupId, tuple[asyncio.Lock, int]] = {}
        self.serial = itertools.count(1)
        # Set when the hub stops: retries give up at this monotonic time.
        self.give_up_at: float | None = None

    def _online(self, group: GroupId) -> int:
        local = len(self.hub.by_group.get(group, ()))
        return max(local, self.online.get(group, (0, 0.0))[0])

    def _big(self, group: GroupId) -> bool:
        return self._online(group) > self.hub.core.settings.big_room_online

    def grabbed(self, g: Grab, remaining: int, *, group_id: GroupId, packet_id: PacketId) -> None:
        item = {
            "packet_id": packet_id,
            "user": g.user_id,
            "amount": g.amount,
            "seq": g.seq,
            "ms": g.grabbed_ms,
            "remaining": remaining,
        }
        self.pending.setdefault(group_id, []).append(item)
        if group_id in self.timers:
            return
        s = self.hub.core.settings
        interval = protocol.announce_interval(
            self.base, self._online(group_id), s.big_room_online, s.big_room_frames_per_second
        )
        now = time.monotonic()
        wait = self.last_sent.get(group_id, 0.0) + interval - now
        if self._big(group_id):
            # A big room's first grab waits an interval too: a hot packet that empties within it is
            # shown once, by its ``finished`` event, not by a grabs event to every member as well.
            wait = max(wait, interval)
        if wait <= 0:
            self.hub.spawn(self.flush(group_id))
        else:
            loop = asyncio.get_running_loop()
            self.timers[group_id] = loop.call_later(wait, lambda: self.hub.spawn(self.flush(group_id)))

    async def flush(self, group: GroupId) -> None:
        timer = self.timers.pop(group, None)
        if timer is not None:
            timer.cancel()
        items = self.pending.pop(group, [])
        if not items:
            return
        self.last_sent[group] = time.monotonic()
        listed = self.hub.core.settings.big_room_grabs_listed if self._big(group) else None
        data = protocol.grabs_announcement(items, listed)
        once = Once(f"grabs:{self.hub.id}:{next(self.serial)}", GRABS_ONCE_SECONDS)
        await self._deliver(group, "grabs", data, once, len(items))
        _, read_at = self.online.get(group, (0, 0.0))
        if time.monotonic() - read_at > self.ONLINE_TTL:
            try:
                self.online[group] = (await self.hub.online_count(group), time.monotonic())
            except RedisError:
                pass  # the last count stands until the next announcement

    async def finished(self, *, group_id: GroupId, packet_id: PacketId, viewer_id: UserId) -> None:
        """The packet's last share went (grabbed by ``viewer_id``): its grabs first, then the result. In
        a big room the packet's grabs not yet announced ride on the result instead (listed as a big
        room's grabs event lists them): one frame to every member, not two."""
        listed = self.hub.core.settings.big_room_grabs_listed if self._big(group_id) else None
        riding = self._take(group_id, packet_id) if listed is not None else []
        if listed is None:
            await self.flush(group_id)
        data = await self._retrying(
            f"the result of packet {packet_id}",
            lambda: _result(self, group_id=group_id, packet_id=packet_id, viewer_id=viewer_id),
        )
        if data is not None:
            if riding:
                data.update(protocol.grabs_announcement(riding, listed))
            once = Once(f"finished:{packet_id}", packet_lifetime(self.hub.core))
            await self._deliver(group_id, "finished", data, once, 1)

    def _take(self, group: GroupId, packet_id: PacketId) -> list[dict[str, Any]]:
        """This packet's pending grabs, taken out of the group's next announcement."""
        items = self.pending.get(group, [])
        mine = [item for item in items if item["packet_id"] == packet_id]
        if mine:
            self.pending[group] = [item for item in items if item["packet_id"] != packet_id]
        return mine

    async def _deliver(self, group: GroupId, kind: str, data: dict[str, Any], once: Once, n: int) -> None:
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


async def _result(
    a: Announcer, *, group_id: GroupId, packet_id: PacketId, viewer_id: UserId
) -> dict[str, Any]:
    v = await grabs.open_packet(a.hub.core, packet_id=packet_id, group_id=group_id, user_id=viewer_id)
    best = v.best_luck
    return {
        "packet_id": packet_id,
        "total": v.total,
        "count": v.count,
        "duration_ms": v.duration_ms,
        "best_luck": None if best is None else {"user": best.user_id, "amount": best.amount},
        "commitment": v.commitment,
        "seed": v.seed,  # revealed: every share went (redpacket_client.fairness)
    }
