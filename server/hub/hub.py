"""The hub of one process: which local connections are in which group, one pub/sub connection for all
of them, and the fan-out of each group event to every local member, encoded once per format.

A group's channel is subscribed while at least one local member of it is online. If the pub/sub
connection drops, the hub reconnects, resubscribes, and replays what it missed from each group's stream
(or tells its clients to resync when the stream no longer has it): nothing is lost silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Iterator
from typing import Any

from redpacket_client.protocol import offset_key
from server.core import Core, transient
from server.hub import protocol
from server.hub.announce import Announcer
from server.hub.connection import Connection, OffsetKey
from server.hub.frames import data_frame
from server.hub.groupreads import GroupReads
from server.hub.hooks import Hooks
from server.hub.metrics import HubMetrics
from server.hub.packetcache import PacketCache
from server.hub.subscriber import Subscriber
from server.ids import GroupId, PacketId, UserId
from server.live import events
from server.live.bots import AttemptLog
from server.money.groups import MemberCounts
from server.money.membership import parse_change
from server.stopping import STOP_SECONDS, check_cancelled, stop
from server.store import keys
from server.store.scriptcalls import Once, PresenceAction, PresenceCall, run

log = logging.getLogger(__name__)

# Users per presence script call (their keys all in the group's slot).
PRESENCE_BATCH = 500
# Sockets an event is written to per loop iteration before other work gets a turn.
FANOUT_CHUNK = 1000


class Hub:
    def __init__(self, core: Core, metrics: HubMetrics) -> None:
        self.core = core
        self.metrics = metrics
        # The chat backend's say before money moves (REDPACKET_HOOK_URL; off without it).
        self.hooks = Hooks(core, metrics)
        self.id = uuid.uuid4().hex[:12]
        self.serial = itertools.count(1)
        self.by_group: dict[GroupId, set[Connection]] = {}
        self.by_user: dict[UserId, set[Connection]] = {}
        self.slots = SocketSlots(self.by_user)
        # (group, user) → that user's local connections in the group: presence changes at 0 ↔ 1.
        self.local: dict[tuple[GroupId, UserId], int] = {}
        self.delivered: dict[GroupId, str] = {}
        self.announcer = Announcer(self)
        self.packet_cache = PacketCache(core)
        self.member_counts = MemberCounts()
        self.group_reads = GroupReads(core.db, self.member_counts, self.spawn)
        self._presence_pending: list[tuple[GroupId, UserId, PresenceAction]] = []
        self._fanouts: deque[_FanOut] = deque()
        self.attempts = AttemptLog(core)
        self.subscriber = Subscriber(core.nodes, self._on_message, self._fill_gaps)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._refresher: asyncio.Task[None] | None = None

    # -- lifecycle ---------------------------------------------------------------------------------

    async def __aenter__(self) -> Hub:
        self.metrics.watch_gc()
        await self.hooks.__aenter__()
        await self.subscriber.start([keys.membership_channel()])
        self._refresher = asyncio.create_task(self._refresh_presence())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.group_reads.close()  # (no welcome reads the database any more)
        # Budget for announcements still pending if Redis is down: a part of the shutdown budget.
        await self.announcer.close(min(5.0, self.core.settings.shutdown_seconds / 4))
        await self.attempts.close()
        if self._refresher is not None:
            await stop([self._refresher], "the hub's presence refresher")
        await self.subscriber.close()
        self.metrics.unwatch_gc()
        if self._tasks:  # (each is one announcement or presence change, retried within the budget above)
            _done, left = await asyncio.wait(self._tasks, timeout=STOP_SECONDS)
            await stop(left, "the hub's background work", within=0.5)
        await self.hooks.__aexit__()

    def spawn(self, work: Awaitable[Any]) -> None:
        """Run background work (announcements, presence) that must not hold up a reply; kept until done."""

        async def run() -> None:
            try:
                await work
            except Exception as e:
                if transient(e):  # Redis or the database away: a line, not a traceback
                    log.warning("hub background task left undone: %s", e)
                else:
                    log.exception("hub background task failed")

        task = asyncio.create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def publish(self, group: GroupId, kind: str, data: dict[str, Any], once: Once | None = None) -> str:
        offset = await events.publish(self.core, group, kind, data, once)
        self.metrics.events_published.inc()
        return offset

    # -- membership of local connections -------------------------------------------------------------

    async def join(self, conn: Connection, groups: list[GroupId]) -> None:
        self.by_user.setdefault(conn.user_id, set()).add(conn)
        self.metrics.connections.inc()
        for g in groups:
            conn.hold(g)  # until the client syncs it (``Connection.hold``)
            await self._attach(conn, g)

    async def leave(self, conn: Connection) -> None:
        """Take a connection out of its groups; safe to call for one that never fully joined."""
        for g in list(conn.groups):
            await self._detach(conn, g)
        mine = self.by_user.get(conn.user_id)
        if mine is not None and conn in mine:
            mine.discard(conn)
            if not mine:
                del self.by_user[conn.user_id]
            self.metrics.connections.dec()

    async def _attach(self, conn: Connection, g: GroupId) -> None:
        conn.groups.add(g)
        members = self.by_group.setdefault(g, set())
        members.add(conn)
        pair = (g, conn.user_id)
        self.local[pair] = self.local.get(pair, 0) + 1
        if len(members) == 1:
            await self.subscriber.add(keys.group_channel(g))
        if self.local[pair] == 1:
            self._presence_soon(g, conn.user_id, "join")

    async def _detach(self, conn: Connection, g: GroupId) -> None:
        conn.forget(g)
        members = self.by_group.get(g)
        if members is None:
            return
        if conn not in members:
            return
        members.discard(conn)
        pair = (g, conn.user_id)
        self.local[pair] -= 1
        if self.local[pair] == 0:
            del self.local[pair]
            self._presence_soon(g, conn.user_id, "leave")
        if not members:
            del self.by_group[g]
            await self.subscriber.remove(keys.group_channel(g))

    async def no_longer_member(self, *, group_id: GroupId, user_id: UserId) -> None:
        """The member cache says ``user_id`` left ``group_id`` and this hub did not hear it (a note lost to a
        subscriber reconnect or a failover): act as the note would have."""
        await self._membership_changed(group_id, [user_id], "removed")

    async def recheck_members(self, pairs: list[tuple[GroupId, UserId]]) -> None:
        """Check these (group, user) pairs against the member cache at once (one pipeline): each the cache
        says left, and this hub did not hear of, is acted on as its note would have been."""
        still = await asyncio.gather(
            *(self.core.membership.is_member(group_id=g, user_id=u) for g, u in pairs)
        )
        for (g, u), member in zip(pairs, still, strict=True):
            if not member:
                await self.no_longer_member(group_id=g, user_id=u)

    async def _recheck_members(self) -> None:
        """After this hub was not listening, check every (group, user) it serves: a removal whose note it
        missed takes its sockets out of the group now, not at their next request."""
        pairs = list(self.local)
        for start in range(0, len(pairs), 1_000):
            await self.recheck_members(pairs[start : start + 1_000])

    async def _membership_changed(self, group: GroupId, users: list[UserId], change: str) -> None:
        self.member_counts.forget(group)
        if change == "exactly":  # the whole membership: this hub's sockets follow it both ways
            members = set(users)
            gone = {c.user_id for c in self.by_group.get(group, ()) if c.user_id not in members}
            here = [u for u in members if any(group not in c.groups for c in self.by_user.get(u, ()))]
            await self._membership_changed(group, sorted(gone), "removed")
            await self._membership_changed(group, sorted(here), "added")
            return
        for user in users:
            for conn in list(self.by_user.get(user, ())):
                if change == "removed" and group in conn.groups:
                    await self._detach(conn, group)
                    conn.send({"type": "removed", "group": group})
                elif change == "added" and group not in conn.groups:
                    await self._attach(conn, group)
                    conn.send({"type": "added", "group": group})

    # -- presence --------------------------------------------------------------------------------------

    def _presence_soon(self, group: GroupId, user: UserId, action: PresenceAction) -> None:
        """Queue a join or leave; those of one loop tick go out together, in order, as one script call
        per run of one action in one group (a reconnect storm is not one call per socket)."""
        self._presence_pending.append((group, user, action))
        if len(self._presence_pending) == 1:
            asyncio.get_running_loop().call_soon(lambda: self.spawn(self._presence_flush()))

    async def _presence_flush(self) -> None:
        pending, self._presence_pending = self._presence_pending, []
        runs: list[tuple[GroupId, PresenceAction, list[UserId]]] = []
        for g, user, action in pending:
            if runs and runs[-1][:2] == (g, action) and len(runs[-1][2]) < PRESENCE_BATCH:
                runs[-1][2].append(user)
            else:
                runs.append((g, action, [user]))
        # Each call is queued before the next starts: they reach Redis in this order.
        await asyncio.gather(*(self._presence(g, users, action) for g, action, users in runs))

    async def _presence(self, group: GroupId, users: list[UserId], action: PresenceAction) -> None:
        lapse = int(time.time() * 1000) + self.core.settings.presence_lapse_seconds * 1000
        call = PresenceCall(group_id=group, hub_id=self.id, action=action, lapse_ms=lapse, users=users)
        came_or_went = await run(self.core.batcher, self.core.scripts, call)
        if not came_or_went or action == "refresh":
            return
        limit = self.core.settings.presence_event_limit
        if len(self.by_group.get(group, ())) > limit:
            return  # more online here alone than events are sent for: no need to count them all
        # In a big room join/leave events would outnumber everything else; clients ask instead.
        if await self.online_count(group) <= limit:
            for u in came_or_went:
                await self.publish(group, "presence", {"user": u, "online": action == "join"})

    async def online_count(self, group: GroupId) -> int:
        """Members of the group online on any hub (entries of a dead hub count until they lapse)."""
        key = keys.presence_online(group)
        return int(await self.core.batcher.call(lambda pipe: pipe.zcard(key), key))

    async def online(self, group: GroupId) -> list[UserId]:
        now = int(time.time() * 1000)
        key = keys.presence_online(group)
        users = await self.core.batcher.call(lambda pipe: pipe.zrangebyscore(key, f"({now}", "+inf"), key)
        return sorted(UserId(int(u)) for u in users)

    async def _refresh_presence(self) -> None:
        """Keep this hub's users online while connected; a crashed hub's entries lapse on their own."""
        every = max(1.0, self.core.settings.presence_lapse_seconds / 3)
        while True:
            check_cancelled()
            await asyncio.sleep(every)
            users: dict[GroupId, list[UserId]] = {}
            for g, user in list(self.local):
                users.setdefault(g, []).append(user)
            for g, members in users.items():
                for i in range(0, len(members), PRESENCE_BATCH):
                    with contextlib.suppress(Exception):
                        await self._presence(g, members[i : i + PRESENCE_BATCH], "refresh")

    # -- pub/sub -------------------------------------------------------------------------------------

    async def _fill_gaps(self) -> None:
        """After a reconnect or a failover, send each group's events published while we were not
        listening."""
        self.metrics.pubsub_reconnects.inc()
        try:
            await self._recheck_members()
        except Exception as e:  # Redis or the database still shaky: each request checks again anyway
            log.warning("after reconnecting, members could not be checked again: %s", e)
        for g in list(self.by_group):
            since = self.delivered.get(g)
            if since is None:
                continue
            missed = await events.since(self.core, g, since, self.core.settings.sync_limit)
            if missed.too_old:
                for conn in list(self.by_group.get(g, ())):
                    conn.send({"type": "gap", "group": g})
                continue
            for offset, kind, data in missed.events:
                self._fan_out(g, offset, kind, data)

    def _on_message(self, channel: bytes, data: bytes) -> None:
        if channel == keys.membership_channel().encode():
            self.spawn(self._membership_changed(*parse_change(data)))
            return
        g = keys.channel_group(channel)
        if g is None:
            return
        offset, _, payload = data.partition(b"\n")
        kind, body = events.unpack(payload)
        self._fan_out(g, offset.decode(), kind, body)

    def _fan_out(self, g: GroupId, offset: str, kind: str, data: dict[str, Any]) -> None:
        """Send a group event to every local member. A big room is served ``FANOUT_CHUNK`` sockets per
        loop iteration, so replies (and other rooms) are not held up for a whole fan-out; events are
        served strictly one after another, so each socket still gets them in order."""
        self.delivered[g] = offset
        conns = self.by_group.get(g)
        if not conns:
            return
        if kind == "finished":
            self.packet_cache.mark_closed(group_id=g, packet_id=PacketId(int(data["packet_id"])))
        packet = None
        if kind == "packet":
            packet = PacketId(int(data["packet_id"]))
            self.packet_cache.mark_known(group_id=g, packet_id=packet)
        job = _FanOut(g, offset_key(offset), protocol.event(g, offset, kind, data), list(conns), packet)
        self._fanouts.append(job)
        if len(self._fanouts) == 1:
            self._fan_out_some()

    def _fan_out_some(self) -> None:
        budget = FANOUT_CHUNK
        sent = 0
        while self._fanouts and budget > 0:
            job = self._fanouts[0]
            end = min(len(job.conns), job.done + budget)
            shown = int(time.time() * 1000)
            for conn in job.conns[job.done : end]:
                if job.packet is not None:  # when the packet was shown here: the bot detector's clock
                    conn.announced[job.packet] = shown
                    if len(conn.announced) > 256:  # keep the recent packets only
                        del conn.announced[next(iter(conn.announced))]
                pair = job.frames.get(conn.dialect)
                if pair is None:
                    # Encoded once per format, framed once per format for every plain socket.
                    payload = protocol.encode(conn.dialect, job.message)
                    pair = job.frames[conn.dialect] = (payload, data_frame(payload))
                sent += conn.deliver(job.group, job.key, pair[0], pair[1])
            budget -= end - job.done
            job.done = end
            if job.done == len(job.conns):
                self._fanouts.popleft()
        self.metrics.frames_out.inc(sent)
        if self._fanouts:
            asyncio.get_running_loop().call_soon(self._fan_out_some)


class SocketSlots:
    """A user's sockets on this hub, counted against ``max_sockets_per_user``: the open ones
    (``Hub.by_user``), those being welcomed — so that sockets opened at once cannot all pass the check
    while the first waits on the database — and those out of the rooms whose TCP connection is not gone
    yet (a socket's slot is free only once its transport is)."""

    __slots__ = ("arriving", "by_user", "leaving")

    def __init__(self, by_user: dict[UserId, set[Connection]]) -> None:
        self.by_user = by_user
        self.arriving: dict[UserId, int] = {}
        self.leaving: dict[UserId, int] = {}

    def held(self, user: UserId) -> int:
        return len(self.by_user.get(user, ())) + self.arriving.get(user, 0) + self.leaving.get(user, 0)

    @contextlib.contextmanager
    def welcoming(self, user: UserId) -> Iterator[None]:
        """A slot held while the socket is welcomed (take it with no await after checking ``held``)."""
        with _counted(self.arriving, user):
            yield

    @contextlib.contextmanager
    def closing(self, user: UserId) -> Iterator[None]:
        """A slot held from leaving the rooms until the TCP connection is gone."""
        with _counted(self.leaving, user):
            yield


@contextlib.contextmanager
def _counted(counts: dict[UserId, int], user: UserId) -> Iterator[None]:
    counts[user] = counts.get(user, 0) + 1
    try:
        yield
    finally:
        counts[user] -= 1
        if not counts[user]:
            del counts[user]


class _FanOut:
    """One group event on its way to the local members of the group."""

    __slots__ = ("conns", "done", "frames", "group", "key", "message", "packet")

    def __init__(
        self,
        group: GroupId,
        key: OffsetKey,
        message: dict[str, Any],
        conns: list[Connection],
        packet: PacketId | None,
    ) -> None:
        self.group = group
        self.key = key
        self.message = message
        self.conns = conns
        self.packet = packet
        self.done = 0
        self.frames: dict[protocol.Dialect, tuple[bytes | str, bytes]] = {}
