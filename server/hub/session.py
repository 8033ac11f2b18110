"""One websocket session: authenticate, join the user's groups, read requests, answer each exactly once.

Requests of one connection are handled one at a time, in order (``Session``), each by its handler in
``server.hub.requests``. Frames come from the
socket's protocol by callback and replies go straight to its transport (``server.hub.wire``). A request
being handled when the client disconnects (or the hub shuts down) runs to the end: a grab in flight is
never cut between its Lua call and its credit record.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable
from dataclasses import asdict
from typing import Any

from starlette.websockets import WebSocket

from server import errors, text
from server.core import unavailable
from server.errors import Forbidden, RedPacketError, Unavailable
from server.hub import protocol
from server.hub.connection import Connection
from server.hub.guards import Guards
from server.hub.hub import Hub
from server.hub.packetcache import Turn
from server.hub.protocol import Body, Message, ProtocolError, field_int
from server.hub.ratelimit import KeyedBuckets, TokenBucket
from server.hub.requests import HANDLERS, Answer, Later
from server.hub.tokens import TokenError
from server.hub.upgrade import EXTENSION
from server.hub.wire import HubWebSocket
from server.ids import GroupId
from server.money import ledger

log = logging.getLogger(__name__)


class Session:
    """The requests of one socket, in order, one at a time. A request answered from memory (``ping``, a
    grab of a packet the hub knows is closed) is answered as its frame is parsed; one that needs Redis
    or the database runs as a task, and frames that come meanwhile wait (reading pauses past
    ``WAITING_LIMIT``). Nothing cancels that task: a grab in flight is never cut."""

    WAITING_LIMIT = 32
    __slots__ = ("bucket", "conn", "core", "hub", "inflight", "stopped", "strikes", "user_msgs", "waiting")

    def __init__(self, hub: Hub, conn: Connection, user_msgs: KeyedBuckets) -> None:
        self.hub = hub
        # The user's messages over all their sockets on this hub (``Guards.user_msgs``).
        self.user_msgs = user_msgs
        self.core = hub.core
        self.conn = conn
        s = self.core.settings
        self.bucket = TokenBucket(s.msgs_per_second, s.msgs_burst, time.monotonic())
        self.strikes = 0
        self.inflight: asyncio.Future[Any] | None = None
        self.waiting: deque[bytes | str] | None = None  # made when a frame has to wait
        self.stopped = False

    def member_of(self, body: Body) -> GroupId:
        """The request's group, if this socket is in it (a grab is checked again in Redis, a send in the
        database)."""
        group = GroupId(field_int(body, "group"))
        if group not in self.conn.groups:
            raise Forbidden(errors.NOT_MEMBER, f"you are not a member of group {group}")
        return group

    async def member_now(self, body: Body) -> GroupId:
        """``member_of``, then the group's versioned member cache (``server.money.membership``): a hub that
        missed the note of a removal (its subscriber reconnecting, a failover) still refuses the removed
        member, and takes its sockets out of the group as the note would have."""
        group = self.member_of(body)
        if not await self.core.membership.is_member(group_id=group, user_id=self.conn.user_id):
            await self.hub.no_longer_member(group_id=group, user_id=self.conn.user_id)
            raise Forbidden(errors.NOT_MEMBER, f"you are not a member of group {group}")
        return group

    # -- wire.Listener --------------------------------------------------------------------------------

    def on_message(self, frame: bytes | str) -> None:
        if self.stopped or self.conn.closing:
            return  # the hub is closing this socket: what it still sends is not handled
        if self.inflight is not None or self.waiting:
            if self.waiting is None:
                self.waiting = deque()
            self.waiting.append(frame)
            if len(self.waiting) >= self.WAITING_LIMIT:
                self.conn.wire.hold_reading()
            return
        self._run(frame)

    def on_writable(self) -> None:
        self.conn.on_writable()

    def on_gone(self) -> None:
        self.conn.gone()

    def stop(self) -> None:
        """The socket is gone: frames not started are dropped (the one in flight finishes)."""
        self.stopped = True
        self.waiting = None

    # -- running requests -----------------------------------------------------------------------------

    def _run(self, frame: bytes | str) -> None:
        """Answer this frame and those waiting behind it, until one has to wait."""
        while not self._start(frame):
            if not self.waiting or self.stopped:
                self.conn.wire.resume_reading()
                return
            frame = self.waiting.popleft()

    def _next(self) -> None:
        self.inflight = None
        if self.waiting and not self.stopped:
            self._run(self.waiting.popleft())
        else:
            self.conn.wire.resume_reading()

    async def _finish(self, rid: int | str, work: Awaitable[Message], kind: str) -> None:
        try:
            reply = protocol.reply_ok(rid, await work)
        except Exception as e:
            reply = self._error(rid, kind, e)
        self._answer(kind, reply)
        self._next()

    def _settle(self, rid: int | str, kind: str, result: Answer | Later) -> bool:
        """Answer with ``result`` now, or start what it waits for; True while it is not answered."""
        if isinstance(result, dict):
            self._answer(kind, protocol.reply_ok(rid, result))
            return False
        if isinstance(result, Later):
            later = result
            self.inflight = later.turn
            later.turn.add_done_callback(lambda turn: self._after(rid, kind, later, turn))
            return True
        self.inflight = asyncio.get_running_loop().create_task(self._finish(rid, result, kind))
        return True

    def _after(self, rid: int | str, kind: str, later: Later, turn: asyncio.Future[Turn]) -> None:
        try:
            # (A cancelled turn is taken as closed: answered from what is known, else by Redis.)
            result = later.answer(Turn.CLOSED if turn.cancelled() else turn.result())
        except Exception as e:
            self._answer(kind, self._error(rid, kind, e))
            self._next()
            return
        if not self._settle(rid, kind, result):
            self._next()

    def _start(self, frame: bytes | str) -> bool:
        """Answer this frame now (False), or start what its answer waits for (True)."""
        self.hub.metrics.frames_in.inc()
        now = time.monotonic()
        if not self.bucket.take(now) or not self.user_msgs.take(self.conn.user_id, now):
            self.strikes += 1
            rid = protocol.request_id_of(_try_decode(frame))
            self.conn.reply(protocol.reply_error(rid, errors.RATE_LIMITED, "too many messages: slow down"))
            if self.strikes > self.core.settings.msgs_burst:  # answered, then closed (after the answer)
                self.conn.close(protocol.CLOSE_RATE_LIMITED, "too many messages")
            return False
        self.strikes = 0
        try:
            req = protocol.parse_request(
                protocol.decode(frame), self.core.settings.max_nesting, self.conn.dialect.text_ids
            )
        except ProtocolError as e:
            rid = protocol.request_id_of(_try_decode(frame))
            self.conn.reply(protocol.reply_error(rid, e.code, e.message))
            return False
        try:
            result = HANDLERS[req.type](self, req.body)
        except Exception as e:
            self._answer(req.type, self._error(req.id, req.type, e))
            return False
        return self._settle(req.id, req.type, result)

    def _answer(self, kind: str, reply: Message) -> None:
        # A sync's reply comes after the events it replayed; every other reply may pass queued events.
        if kind == "sync":
            self.conn.send(reply)
        else:
            self.conn.reply(reply)

    @staticmethod
    def _error(rid: int | str, kind: str, e: Exception) -> Message:
        if isinstance(e, RedPacketError):
            return protocol.reply_error(rid, e.code, e.message, e.details)
        down = unavailable(e)
        if down is not None:
            return protocol.reply_error(rid, down.code, down.message)
        log.error("request %s failed", kind, exc_info=e)
        return protocol.reply_error(rid, errors.INTERNAL, "internal error")


def _try_decode(frame: bytes | str) -> Any:
    try:
        return protocol.decode(frame)
    except ProtocolError:
        return None


# -- the websocket endpoint -------------------------------------------------------------------------------


async def websocket_endpoint(ws: WebSocket) -> None:
    hub: Hub = ws.app.state.hub
    guards: Guards = ws.app.state.guards
    core = hub.core
    wire = ws.scope.get("extensions", {}).get(EXTENSION)
    if not isinstance(wire, HubWebSocket):
        # The hub writes its frames below ASGI (server.hub.wire): it runs under `redpacket serve` / `up`.
        log.error(
            "websocket refused: the hub needs uvicorn with server.hub.wire's protocol (redpacket serve)"
        )
        await ws.close(1011)
        return
    if not protocol.origin_allowed(
        ws.headers.get("origin"), ws.headers.get("host"), core.settings.allowed_origin_list
    ):
        hub.metrics.limited.labels("origin").inc()
        await ws.close(protocol.CLOSE_POLICY, errors.ORIGIN_NOT_ALLOWED)  # before the upgrade: answered 403
        return
    offered = list(ws.scope.get("subprotocols", []))
    dialect = protocol.choose_dialect(offered)
    await ws.accept(subprotocol=dialect.subprotocol)
    try:
        user_id = await guards.tokens.user(protocol.offered_token(offered) or ws.query_params.get("token"))
    except TokenError as e:
        await ws.close(protocol.CLOSE_UNAUTHORIZED, e.code)
        return
    except Unavailable as e:  # the backend's JWKS cannot be fetched: the token is not known bad
        await ws.close(protocol.CLOSE_TRY_AGAIN, e.code)
        return
    if hub.slots.held(user_id) >= core.settings.max_sockets_per_user:
        hub.metrics.limited.labels("sockets").inc()
        await ws.close(protocol.CLOSE_TOO_MANY_SOCKETS, "too_many_sockets")
        return
    conn = Connection(hub, wire, user_id, dialect, device=text.device_id(ws.query_params.get("device", "")))
    with hub.slots.welcoming(user_id):  # (no await since the check)
        welcomed = await _welcome(ws, hub, conn)
    if not welcomed:
        return
    session = Session(hub, conn, guards.user_msgs)
    wire.listen(session)  # frames that came before the welcome are handled now, in order
    if wire.close_sent or wire.disconnected:
        conn.gone()  # it ended before it was listened to
    try:
        await asyncio.shield(conn.ended)  # the client went, or the hub closes it
    finally:
        session.stop()
        # Out of the rooms now; the user's socket slot stays taken until the TCP connection is really
        # gone (``wire.lost``, which the socket's close timeout bounds).
        with hub.slots.closing(user_id):
            await hub.leave(conn)
            # A request already started finishes (nothing cancels it), then the socket closes.
            while session.inflight is not None:  # a grab's turn, then its call to Redis
                inflight = session.inflight
                with contextlib.suppress(Exception):
                    await inflight
                if session.inflight is inflight:
                    break
            # Closed with our code after what waits is written; cut if the client does not read it.
            wire.close(conn.close_code if conn.closing else protocol.CLOSE_NORMAL, conn.close_reason)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(wire.lost), wire.close_seconds + 5)


async def _welcome(ws: WebSocket, hub: Hub, conn: Connection) -> bool:
    """Join the user's groups and send ``welcome``; False if the socket was closed instead."""
    try:
        # Bounded: a stalled database or Redis must not hold the socket open unanswered.
        async with asyncio.timeout(hub.core.settings.handshake_seconds):
            mine = await hub.group_reads.of(conn.user_id)
            if not mine and not await ledger.user_exists(hub.core.db, conn.user_id):
                await ws.close(protocol.CLOSE_USER_UNKNOWN, errors.USER_NOT_FOUND)
                return False
            await hub.join(conn, [g["group_id"] for g in mine])
    except Exception as e:
        down = unavailable(e)
        if down is None and not isinstance(e, TimeoutError):
            raise
        await hub.leave(conn)
        why = down.message if down else "timed out"
        if conn.wire.disconnected or conn.wire.close_sent:
            # The client went away meanwhile: nobody to answer, nothing to warn of (and no traceback).
            log.info("user %d left before its welcome (%s)", conn.user_id, why)
            return False
        log.warning("connection of user %d refused: %s", conn.user_id, why)
        # (Gone between the look above and this close: uvicorn's ClientDisconnected, an OSError.)
        with contextlib.suppress(OSError):
            await ws.close(protocol.CLOSE_TRY_AGAIN, down.code if down else "timeout")
        return False
    conn.send(
        {
            "type": "welcome",
            "version": conn.dialect.version,
            "user": conn.user_id,
            "connection": conn.id,
            "hub": hub.id,
            "groups": mine,
            "server_ms": int(time.time() * 1000),
            "limits": {
                **asdict(hub.core.limits),
                "packet_ttl_seconds": hub.core.settings.packet_ttl_seconds,
            },
        }
    )
    return True
