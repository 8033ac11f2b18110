"""One websocket session: authenticate, join the user's groups, read requests, answer each exactly once.

Requests of one connection are handled one at a time, in order (``Session``). Frames come from the
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
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

from starlette.websockets import WebSocket

from server import errors, text
from server.core import unavailable
from server.errors import Forbidden, InvalidRequest, RedPacketError, Unavailable
from server.hub import announce, events, protocol
from server.hub.botscore import Attempt
from server.hub.hub import Connection, Hub
from server.hub.protocol import ProtocolError, field_id, field_int, offset_key
from server.hub.ratelimit import TokenBucket
from server.hub.tokens import TokenError
from server.hub.wire import EXTENSION, HubWebSocket
from server.money import groups, packets

log = logging.getLogger(__name__)

Answer = dict[str, Any] | Awaitable[dict[str, Any]]


@dataclass(frozen=True)
class Later:
    """An answer that waits for ``turn`` without a task of its own; then ``then(turn's result)``."""

    turn: asyncio.Future[bool]
    then: Callable[[bool], Answer]


# A handler answers at once (a dict), returns what to await for the answer, or a ``Later``; errors are
# RedPacketErrors.
Handler = Callable[["Session", dict[str, Any]], "Answer | Later"]


class Session:
    """The requests of one socket, in order, one at a time. A request answered from memory (``ping``, a
    grab of a packet the hub knows is closed) is answered as its frame is parsed; one that needs Redis
    or the database runs as a task, and frames that come meanwhile wait (reading pauses past
    ``WAITING_LIMIT``). Nothing cancels that task: a grab in flight is never cut."""

    WAITING_LIMIT = 32
    __slots__ = ("bucket", "conn", "core", "hub", "inflight", "stopped", "strikes", "waiting")

    def __init__(self, hub: Hub, conn: Connection) -> None:
        self.hub = hub
        self.core = hub.core
        self.conn = conn
        s = self.core.settings
        self.bucket = TokenBucket(s.msgs_per_second, s.msgs_burst, time.monotonic())
        self.strikes = 0
        self.inflight: asyncio.Future[Any] | None = None
        self.waiting: deque[bytes | str] | None = None  # made when a frame has to wait
        self.stopped = False

    def member_of(self, body: dict[str, Any]) -> int:
        group = field_int(body, "group")
        if group not in self.conn.groups:
            raise Forbidden(errors.NOT_MEMBER, f"you are not a member of group {group}")
        return group

    # -- wire.Listener --------------------------------------------------------------------------------

    def on_message(self, frame: bytes | str) -> None:
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

    async def _finish(self, rid: int | str, work: Awaitable[dict[str, Any]], kind: str) -> None:
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

    def _after(self, rid: int | str, kind: str, later: Later, turn: asyncio.Future[bool]) -> None:
        try:
            result = later.then(not turn.cancelled() and turn.result())
        except Exception as e:
            self._answer(kind, self._error(rid, kind, e))
            self._next()
            return
        if not self._settle(rid, kind, result):
            self._next()

    def _start(self, frame: bytes | str) -> bool:
        """Answer this frame now (False), or start what its answer waits for (True)."""
        self.hub.metrics.frames_in.inc()
        if not self.bucket.take(time.monotonic()):
            self.strikes += 1
            if self.strikes > self.core.settings.msgs_burst:
                self.conn.close(protocol.CLOSE_RATE_LIMITED, "too many messages")
            rid = protocol.request_id_of(_try_decode(frame))
            self.conn.reply(protocol.reply_error(rid, errors.RATE_LIMITED, "too many messages: slow down"))
            return False
        self.strikes = 0
        try:
            req = protocol.parse_request(protocol.decode(frame), from_msgpack=isinstance(frame, bytes))
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

    def _answer(self, kind: str, reply: dict[str, Any]) -> None:
        # A sync's reply comes after the events it replayed; every other reply may pass queued events.
        if kind == "sync":
            self.conn.send(reply)
        else:
            self.conn.reply(reply)

    @staticmethod
    def _error(rid: int | str, kind: str, e: Exception) -> dict[str, Any]:
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


# -- request handlers: each returns the reply's data or raises a RedPacketError ---------------------------


def on_ping(s: Session, body: dict[str, Any]) -> dict[str, Any]:
    return {"ts": int(time.time() * 1000)}


async def _open_packets(s: Session, group: int) -> list[dict[str, Any]]:
    """The group's newest 20 packets that can still be grabbed (before expiry, with shares left)."""
    now = int(time.time() * 1000)
    rows = await s.core.db.fetchall(
        "SELECT id FROM red_packets WHERE group_id = %s AND status = 'active' AND expires_ms > %s"
        " ORDER BY id DESC LIMIT 20",
        (group, now),
    )
    views = []
    for (pid,) in rows:
        with contextlib.suppress(RedPacketError):
            view = await packets.open_packet(s.core, int(pid), group, s.conn.user_id)
            if view.remaining > 0 and view.expires_ms > now:
                views.append(view_dict(view))
    return views


async def on_sync(s: Session, body: dict[str, Any]) -> dict[str, Any]:
    """Per group: replay what the client missed since its offset, or the current state when it has none
    or the stream no longer holds the gap. Replayed events are sent before this reply."""
    wanted = body.get("groups")
    if not isinstance(wanted, dict):
        raise InvalidRequest(errors.BAD_REQUEST, "groups must map group id to the last offset seen (or null)")
    # Every offset is checked before anything is held or sent: a malformed one refuses the whole sync.
    plan = [(raw, protocol.parse_offset(since)) for raw, since in wanted.items()]
    out: dict[str, Any] = {}
    for raw_group, since in plan:
        group = (
            int(raw_group)
            if isinstance(raw_group, str) and raw_group.isascii() and raw_group.isdigit()
            else raw_group
        )
        if not isinstance(group, int) or group not in s.conn.groups:
            out[str(raw_group)] = {"error": errors.NOT_MEMBER}
            continue
        holding = group not in s.conn.held
        if holding:
            s.conn.held[group] = []  # a second sync of the same group holds live events again meanwhile
        try:
            latest = await events.latest_offset(s.core, group)
            missed = await events.since(s.core, group, since, s.core.settings.sync_limit) if since else None
        except BaseException:
            if holding:  # this sync failed (Redis is down): the group goes on live as before
                s.conn.release(group, s.conn.last.get(group, (0, 0)))
            raise
        if since is None or missed is None or missed.too_old:
            s.conn.release(group, offset_key(latest))
            out[str(group)] = {
                "offset": latest,
                "too_old": since is not None,
                "packets": await _open_packets(s, group),
            }
            continue
        # Never send again what this socket already received: a second sync only adds what is newer.
        s.conn.last[group] = max(offset_key(since), s.conn.last.get(group, (0, 0)))
        for offset, kind, data in missed.events:
            key = offset_key(offset)
            if key > s.conn.last[group]:
                s.conn.last[group] = key
                s.conn.send(protocol.event(group, offset, kind, data))
        s.conn.release(group, s.conn.last[group])
        out[str(group)] = {"offset": latest, "replayed": len(missed.events), "too_old": False}
    return {"groups": out}


async def on_chat(s: Session, body: dict[str, Any]) -> dict[str, Any]:
    group = s.member_of(body)
    said = body.get("text")
    if not isinstance(said, str) or not said.strip() or len(said) > protocol.MAX_TEXT_CHARS:
        raise InvalidRequest(errors.TEXT_INVALID, f"text is 1 to {protocol.MAX_TEXT_CHARS} characters")
    if not text.chat_ok(said):
        raise InvalidRequest(
            errors.TEXT_INVALID, "chat may hold line feeds and tabs, no other control characters or overrides"
        )
    offset = await s.hub.publish(group, "chat", {"user": s.conn.user_id, "text": said})
    return {"offset": offset}


async def on_send(s: Session, body: dict[str, Any]) -> dict[str, Any]:
    group = s.member_of(body)
    request_id = body.get("request_id")
    if request_id is not None and not isinstance(request_id, str):
        raise InvalidRequest(errors.BAD_REQUEST, "request_id must be a string")
    p = await packets.send_packet(
        s.core,
        s.conn.user_id,
        group,
        body.get("kind", "lucky"),
        body.get("total"),
        body.get("count"),
        body.get("greeting", ""),
        body.get("target"),
        request_id,
    )
    # Paid for and saved: announced now, or (offset null) by a retry or a worker once Redis is back.
    s.hub.known.saw_packet(group, p.packet_id)
    offset = await announce.announce_packet(s.core, p)
    if offset is not None and not p.replay:
        s.hub.metrics.events_published.inc()
    return {**announce.packet_event(p), "offset": offset, "replay": p.replay}


def on_grab(s: Session, body: dict[str, Any]) -> Answer | Later:
    started = time.perf_counter()
    metrics = s.hub.metrics
    kp = s.hub.known
    try:
        group = s.member_of(body)
        packet_id = field_id(body, "packet", errors.PACKET_NOT_FOUND)
        _record_attempt(s, group, packet_id)
    except RedPacketError as e:
        metrics.grab_outcomes.labels(e.code).inc()
        raise
    # A packet this hub knows to be closed (or no packet at all) is answered from memory.
    _refuse_if_known(s, group, packet_id)
    # In a storm, grabs beyond the shares left wait their turn (no task each); most are then answered
    # from memory when the packet empties.
    turn = kp.admit(packet_id)
    if turn is True:
        return _grab(s, group, packet_id, started)

    def then(admitted: bool) -> Answer:
        if not admitted:
            _refuse_if_known(s, group, packet_id, started)
            kp.go(packet_id)  # a winner (only Redis answers their share), or the state could not be read
        return _grab(s, group, packet_id, started)

    assert not isinstance(turn, bool)
    return Later(turn, then)


def _refuse_if_known(s: Session, group: int, packet_id: int, started: float | None = None) -> None:
    refusal = s.hub.known.refusal(group, packet_id, s.conn.user_id)
    if refusal is None:
        return
    metrics = s.hub.metrics
    metrics.grab_outcomes.labels(_OUTCOMES.get(refusal, refusal)).inc()
    metrics.grabs_answered_locally.inc()
    if started is not None:
        metrics.grab_seconds.observe(time.perf_counter() - started)
    raise packets.refusal_error(refusal)


_OUTCOMES = {errors.PACKET_EMPTY: "empty", errors.PACKET_EXPIRED: "expired"}


async def _grab(s: Session, group: int, packet_id: int, started: float) -> dict[str, Any]:
    """The grab in Redis, with a slot of the packet's flight (``Known.admit``) already taken."""
    metrics = s.hub.metrics
    kp = s.hub.known
    remaining: int | None = None
    try:
        r = await packets.grab(s.core, packet_id, group, s.conn.user_id, gate=True)
        remaining = r.remaining
        if remaining == 0:
            kp.saw_closed(group, packet_id)
    except RedPacketError as e:
        metrics.grab_outcomes.labels(_OUTCOMES.get(e.code, e.code)).inc()
        if e.code in _OUTCOMES:
            remaining = 0
            kp.saw_closed(group, packet_id)
        elif e.code == errors.PACKET_NOT_FOUND:
            kp.saw_unknown(group, packet_id)
        raise
    finally:
        kp.landed(packet_id, remaining)
        metrics.grab_seconds.observe(time.perf_counter() - started)
    metrics.grab_outcomes.labels(r.outcome).inc()
    if r.outcome == "won":
        s.hub.announcer.grabbed(group, packet_id, r.grab, r.remaining)
        if r.remaining == 0:
            # Exactly one grab empties a packet: it announces the result, after the grabs.
            s.hub.spawn(s.hub.announcer.finished(group, packet_id, s.conn.user_id))
    g = r.grab
    return {
        "packet": packet_id,
        "outcome": r.outcome,
        "user_id": g.user_id,
        "seq": g.seq,
        "amount": g.amount,
        "grabbed_ms": g.grabbed_ms,
        "remaining": r.remaining,
    }


def _record_attempt(s: Session, group: int, packet_id: int) -> None:
    """For the bot detector: who grabbed what, how long after this socket was shown it."""
    shown = s.conn.announced.get(packet_id)
    now = int(time.time() * 1000)
    reaction = None if shown is None else now - shown
    s.hub.attempts.record(Attempt(s.conn.user_id, group, packet_id, reaction, s.conn.device, now))


def _grab_dict(g: packets.Grab | None) -> dict[str, int] | None:
    if g is None:
        return None
    return {"user_id": g.user_id, "seq": g.seq, "amount": g.amount, "grabbed_ms": g.grabbed_ms}


def view_dict(v: packets.PacketView) -> dict[str, Any]:
    """The packet view as the protocol sends it. Written out field by field: ``dataclasses.asdict``
    (recursive, copying) cost a loaded hub an eighth of its CPU, every member opening a 100-grab packet."""
    return {
        "packet_id": v.packet_id,
        "group_id": v.group_id,
        "sender_id": v.sender_id,
        "kind": v.kind,
        "total": v.total,
        "count": v.count,
        "greeting": v.greeting,
        "created_ms": v.created_ms,
        "expires_ms": v.expires_ms,
        "remaining": v.remaining,
        "grabs": [_grab_dict(g) for g in v.grabs],
        "mine": _grab_dict(v.mine),
        "finished_ms": v.finished_ms,
        "best_luck": _grab_dict(v.best_luck),
        "duration_ms": v.duration_ms,
    }


async def on_open(s: Session, body: dict[str, Any]) -> dict[str, Any]:
    group = s.member_of(body)
    return view_dict(
        await packets.open_packet(
            s.core, field_id(body, "packet", errors.PACKET_NOT_FOUND), group, s.conn.user_id
        )
    )


async def on_presence(s: Session, body: dict[str, Any]) -> dict[str, Any]:
    group = s.member_of(body)
    return {"group": group, "online": await s.hub.online(group)}


HANDLERS: dict[str, Handler] = {
    "ping": on_ping,
    "sync": on_sync,
    "chat": on_chat,
    "send": on_send,
    "grab": on_grab,
    "open": on_open,
    "presence": on_presence,
}


# -- the websocket endpoint -------------------------------------------------------------------------------


async def websocket_endpoint(ws: WebSocket) -> None:
    hub: Hub = ws.app.state.hub
    core = hub.core
    wire = ws.scope.get("extensions", {}).get(EXTENSION)
    if not isinstance(wire, HubWebSocket):
        # The hub writes its frames below ASGI (server.hub.wire): it runs under `redpacket serve` / `up`.
        log.error(
            "websocket refused: the hub needs uvicorn with server.hub.wire's protocol (redpacket serve)"
        )
        await ws.close(1011)
        return
    fmt, subprotocol = protocol.choose_format(list(ws.scope.get("subprotocols", [])))
    await ws.accept(subprotocol=subprotocol)
    try:
        user_id = await hub.tokens.user(ws.query_params.get("token"))
    except TokenError as e:
        await ws.close(protocol.CLOSE_UNAUTHORIZED, e.code)
        return
    except Unavailable as e:  # the backend's JWKS cannot be fetched: the token is not known bad
        await ws.close(protocol.CLOSE_TRY_AGAIN, e.code)
        return
    conn = Connection(hub, wire, user_id, fmt, device=text.device_id(ws.query_params.get("device", "")))
    try:
        # Bounded: a stalled database or Redis must not hold the socket open unanswered.
        async with asyncio.timeout(core.settings.handshake_seconds):
            mine = await groups.groups_of(core.db, user_id, hub.member_counts)
            await hub.join(conn, [int(g["group_id"]) for g in mine])  # type: ignore[call-overload]
    except Exception as e:
        down = unavailable(e)
        if down is None and not isinstance(e, TimeoutError):
            raise
        await hub.leave(conn)
        log.warning("connection of user %d refused: %s", user_id, down.message if down else "timed out")
        await ws.close(protocol.CLOSE_TRY_AGAIN, down.code if down else "timeout")
        return
    conn.send(
        {
            "type": "welcome",
            "version": protocol.VERSION,
            "user": user_id,
            "connection": conn.id,
            "hub": hub.id,
            "groups": mine,
            "server_ms": int(time.time() * 1000),
            "limits": {
                **asdict(core.limits),
                "packet_ttl_seconds": core.settings.packet_ttl_seconds,
            },
        }
    )
    session = Session(hub, conn)
    wire.listen(session)  # frames that came before the welcome are handled now, in order
    if wire.close_sent or wire.disconnected:
        conn.gone()  # it ended before it was listened to
    try:
        await asyncio.shield(conn.ended)  # the client went, or the hub closes it
    finally:
        session.stop()
        await hub.leave(conn)
        # A request already started finishes (nothing cancels it), then the socket closes.
        while session.inflight is not None:  # a grab's turn, then its call to Redis
            inflight = session.inflight
            with contextlib.suppress(Exception):
                await inflight
            if session.inflight is inflight:
                break
        if conn.closing and not wire.disconnected and not wire.close_sent:
            # Close with our code once what waits is written, unless the client stopped reading.
            try:
                await asyncio.wait_for(ws.close(conn.close_code, conn.close_reason), 1)
            except Exception:
                _abort(wire)


def _abort(wire: HubWebSocket) -> None:
    """Drop the TCP connection of a client that stopped reading. uvicorn waits for a writable transport
    even to send a close frame, and a closing transport waits to flush, so such a socket would otherwise
    stay open (holding its buffers) for as long as the peer keeps it."""
    wire.transport.abort()
