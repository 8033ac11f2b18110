"""One client socket as the hub sees it (``Connection``): its groups, what it has been sent of each, and
its send queues."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING, Any

from server.hub import protocol
from server.hub.protocol import Dialect
from server.hub.wire import HubWebSocket
from server.ids import GroupId, PacketId, UserId

if TYPE_CHECKING:
    from server.hub.hub import Hub

# An event's place in its group's stream (``server.live.events.offset_key``).
OffsetKey = tuple[int, int]


class Connection:
    """One client socket as the hub sees it. A frame goes straight to the socket's transport while it
    takes more; otherwise it waits in a bounded queue, replies ahead of events, until the transport
    drains (``server.hub.wire``). A client whose queue overflows is too slow and is cut, never waited on.
    ``ended`` resolves when the client has gone or the hub decided to close it (``closing``)."""

    # Ten thousand of these live in a hub: no per-instance dict, queues made only when needed.
    __slots__ = (
        "_events", "_held", "_replies", "announced", "close_code", "close_reason", "closing", "device",
        "dialect", "ended", "groups", "hub", "id", "last", "user_id", "wire",
    )  # fmt: skip

    def __init__(
        self, hub: Hub, wire: HubWebSocket, user_id: UserId, dialect: Dialect, device: str = ""
    ) -> None:
        self.hub = hub
        self.wire = wire
        self.user_id = user_id
        self.dialect = dialect
        self.id = f"{hub.id[:6]}{next(hub.serial) & 0xFFFFFF:06x}"
        # Framed bytes waiting for the transport: replies go out before events (a grab's reply does not
        # wait behind the room's announcements); each kind keeps its own order.
        self._replies: deque[bytes] | None = None
        self._events: deque[bytes] | None = None
        self.groups: set[GroupId] = set()
        # Per group: the newest offset delivered, and the events held (``hold``) while a group is not live.
        self.last: dict[GroupId, OffsetKey] = {}
        self._held: dict[GroupId, list[tuple[OffsetKey, bytes | str]]] = {}
        # When each packet was shown on this socket (unix ms): the bot detector's reaction time.
        self.announced: dict[PacketId, int] = {}
        self.device = device or self.id
        self.closing = False
        self.close_code = protocol.CLOSE_NORMAL
        self.close_reason = ""
        self.ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    @property
    def replies(self) -> deque[bytes]:
        if self._replies is None:
            self._replies = deque()
        return self._replies

    @property
    def events(self) -> deque[bytes]:
        if self._events is None:
            self._events = deque()
        return self._events

    def waiting(self) -> int:
        return (len(self._replies) if self._replies else 0) + (len(self._events) if self._events else 0)

    def _write(self, raw: bytes, reply: bool) -> bool:
        """Write now if nothing it must follow waits and the transport takes it, else queue; False if it
        was dropped. A reply follows only replies; an event follows everything queued."""
        if self.closing:
            return False
        if not self._replies and (reply or not self._events) and self.wire.writable_now:
            self.wire.write(raw)  # the common case: the queues are not even made
            return True
        (self.replies if reply else self.events).append(raw)
        if self.waiting() > self.hub.core.settings.send_queue_frames:
            self.hub.metrics.send_queue_drops.inc()
            self.close(protocol.CLOSE_SLOW_CONSUMER, "send queue overflow: read faster")
            return False
        return True

    def push(self, payload: bytes | str, raw: bytes | None = None) -> bool:
        """Send an event frame (``raw``: the same payload already framed for a plain socket)."""
        return self._write(raw if raw is not None and self.wire.plain else self.wire.frame(payload), False)

    def reply(self, message: dict[str, Any]) -> None:
        """Send a reply: ahead of any events still waiting for the transport."""
        if self._write(self.wire.frame(protocol.encode(self.dialect, message)), True):
            self.hub.metrics.frames_out.inc()

    def send(self, message: dict[str, Any]) -> None:
        """Send a frame in order with the events (a sync's reply after the events it replayed)."""
        if self.push(protocol.encode(self.dialect, message)):
            self.hub.metrics.frames_out.inc()

    def on_writable(self) -> None:
        """The transport drained: write what waits, replies first, until it is full again."""
        wire = self.wire
        for queue in (self._replies, self._events):
            while queue and wire.writable_now:
                wire.write(queue.popleft())

    def gone(self) -> None:
        """The client went away (or the hub is shutting its socket)."""
        if not self.ended.done():
            self.ended.set_result(None)

    # -- events held until the client syncs -----------------------------------------------------------
    # A socket is sent a group's events only once it is live in the group. From the welcome (``Hub.join``)
    # until the client's first ``sync`` of the group, and again while a later sync reads the group, its
    # events are held here, in order; the sync ends the holding with ``release``, which sends those newer
    # than what it replayed, before the sync's reply. So nothing that happens while a client is not yet
    # synced is lost, and nothing is sent twice or out of order. Only the methods below touch ``_held``.

    def hold(self, group: GroupId) -> bool:
        """Hold ``group``'s events from now; False if they were held already."""
        if group in self._held:
            return False
        self._held[group] = []
        return True

    def holding(self, group: GroupId) -> list[OffsetKey]:
        """The offsets of the events held for ``group`` (none when it is live)."""
        return [key for key, _ in self._held.get(group, ())]

    def forget(self, group: GroupId) -> None:
        """Out of ``group``: what was held for it is dropped."""
        self.groups.discard(group)
        self._held.pop(group, None)

    def deliver(self, group: GroupId, key: OffsetKey, frame: bytes | str, raw: bytes | None = None) -> bool:
        """An event of ``group``: sent if this socket is live in the group and has not had it."""
        if group not in self.groups:
            return False
        held = self._held.get(group)
        if held is not None:
            held.append((key, frame))
            if len(held) > self.hub.core.settings.send_queue_frames:
                self.close(protocol.CLOSE_SLOW_CONSUMER, "too many events held before sync")
            return False
        if key <= self.last.get(group, (0, 0)):
            return False
        self.last[group] = key
        return self.push(frame, raw)

    def release(self, group: GroupId, floor: OffsetKey) -> int:
        """End holding a group after a sync up to ``floor``: send the held events newer than it; how many."""
        self.last[group] = max(floor, self.last.get(group, (0, 0)))
        sent = 0
        for key, frame in self._held.pop(group, []):
            if key > self.last[group]:
                self.last[group] = key
                sent += self.push(frame)
        self.hub.metrics.frames_out.inc(sent)
        return sent

    def close(self, code: int, reason: str) -> None:
        """The hub closes this socket with ``code`` (after what is queued, if the client reads)."""
        if not self.closing:
            self.close_code, self.close_reason = code, reason
            self.closing = True
            self.gone()
