"""One websocket session: authenticate, join the user's groups, read requests, answer each exactly once.

Requests of one connection are handled one at a time, in order. A request being handled when the client
disconnects (or the hub shuts down) runs to the end: a grab in flight is never cut between its Lua call
and its credit enqueue.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from server import announce, errors, events, groups, packets, protocol, text
from server.botscore import Attempt
from server.core import unavailable
from server.errors import Forbidden, InvalidRequest, RedPacketError
from server.hub import Connection, Hub
from server.protocol import ProtocolError, Request, field_id, field_int, offset_key
from server.ratelimit import TokenBucket
from server.tokens import TokenError, verify_token

log = logging.getLogger(__name__)

Handler = Callable[["Session", dict[str, Any]], Awaitable[dict[str, Any]]]


class Session:
    def __init__(self, hub: Hub, conn: Connection) -> None:
        self.hub = hub
        self.core = hub.core
        self.conn = conn
        s = self.core.settings
        self.bucket = TokenBucket(s.msgs_per_second, s.msgs_burst, time.monotonic())
        self.strikes = 0
        self.inflight: asyncio.Future[None] | None = None

    def member_of(self, body: dict[str, Any]) -> int:
        group = field_int(body, "group")
        if group not in self.conn.groups:
            raise Forbidden(errors.NOT_MEMBER, f"you are not a member of group {group}")
        return group

    async def handle(self, req: Request) -> dict[str, Any]:
        try:
            return protocol.reply_ok(req.id, await HANDLERS[req.type](self, req.body))
        except RedPacketError as e:
            return protocol.reply_error(req.id, e.code, e.message)
        except Exception as e:
            down = unavailable(e)
            if down is not None:
                return protocol.reply_error(req.id, down.code, down.message)
            log.exception("request %s failed", req.type)
            return protocol.reply_error(req.id, errors.INTERNAL, "internal error")

    async def on_frame(self, frame: bytes | str) -> None:
        self.hub.metrics.frames_in.inc()
        if not self.bucket.take(time.monotonic()):
            self.strikes += 1
            if self.strikes > self.core.settings.msgs_burst:
                self.conn.close(protocol.CLOSE_RATE_LIMITED, "too many messages")
            message = _try_decode(frame)
            rid = protocol.request_id_of(message)
            self.conn.send(protocol.reply_error(rid, errors.RATE_LIMITED, "too many messages: slow down"))
            return
        self.strikes = 0
        try:
            message = protocol.decode(frame)
            req = protocol.parse_request(message)
        except ProtocolError as e:
            self.conn.send(
                protocol.reply_error(protocol.request_id_of(_try_decode(frame)), e.code, e.message)
            )
            return
        self.conn.send(await self.handle(req))


def _try_decode(frame: bytes | str) -> Any:
    try:
        return protocol.decode(frame)
    except ProtocolError:
        return None


# -- request handlers: each returns the reply's data or raises a RedPacketError ---------------------------


async def on_ping(s: Session, body: dict[str, Any]) -> dict[str, Any]:
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
    offset = await announce.announce_packet(s.core, p)
    if offset is not None and not p.replay:
        s.hub.metrics.events_published.inc()
    return {**announce.packet_event(p), "offset": offset, "replay": p.replay}


async def on_grab(s: Session, body: dict[str, Any]) -> dict[str, Any]:
    started = time.perf_counter()
    metrics = s.hub.metrics
    try:
        group = s.member_of(body)
        packet_id = field_id(body, "packet", errors.PACKET_NOT_FOUND)
        _record_attempt(s, group, packet_id)
        r = await packets.grab(s.core, packet_id, group, s.conn.user_id, gate=True)
    except RedPacketError as e:
        outcome = {errors.PACKET_EMPTY: "empty", errors.PACKET_EXPIRED: "expired"}.get(e.code, "denied")
        metrics.grab_outcomes.labels(outcome).inc()
        raise
    finally:
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


def view_dict(v: packets.PacketView) -> dict[str, Any]:
    return {**asdict(v), "duration_ms": v.duration_ms}


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
    fmt, subprotocol = protocol.choose_format(list(ws.scope.get("subprotocols", [])))
    await ws.accept(subprotocol=subprotocol)
    try:
        user_id = verify_token(core.settings.secret.encode(), ws.query_params.get("token"), int(time.time()))
    except TokenError as e:
        await ws.close(protocol.CLOSE_UNAUTHORIZED, e.code)
        return
    conn = Connection(hub, ws, user_id, fmt, device=text.device_id(ws.query_params.get("device", "")))
    try:
        # Bounded: a stalled database or Redis must not hold the socket open unanswered.
        async with asyncio.timeout(core.settings.handshake_seconds):
            mine = await groups.groups_of(core.db, user_id)
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
            "groups": mine,
            "server_ms": int(time.time() * 1000),
        }
    )
    session = Session(hub, conn)
    writer = asyncio.create_task(conn.writer())
    reader = asyncio.create_task(_read(ws, session))
    closing = asyncio.create_task(conn.closing.wait())
    try:
        await asyncio.wait({writer, reader, closing}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        await hub.leave(conn)
        # A request already started finishes (the reader is shielded per request); then stop reading.
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, WebSocketDisconnect, Exception):
            await reader
        if session.inflight is not None:
            with contextlib.suppress(Exception):
                await session.inflight
        closing.cancel()
        if conn.closing.is_set():
            # Let the writer flush what the client can still take, then close with our code.
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await writer
            try:
                await asyncio.wait_for(ws.close(conn.close_code, conn.close_reason), 1)
            except Exception:
                _abort(ws)
        else:
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await writer


def _abort(ws: WebSocket) -> None:
    """Drop the TCP connection of a client that stopped reading. uvicorn waits for a writable transport
    even to send a close frame, and a closing transport waits to flush, so such a socket would otherwise
    stay open (holding its buffers) for as long as the peer keeps it."""
    transport = getattr(getattr(ws._send, "__self__", None), "transport", None)
    if transport is not None:
        transport.abort()


async def _read(ws: WebSocket, session: Session) -> None:
    while True:
        message = await ws.receive()
        if message["type"] == "websocket.disconnect":
            return
        frame = message.get("bytes")
        if frame is None:
            frame = message.get("text")
        if frame is None:
            continue
        # Shielded: cancelling the reader (the client left, the hub stops) never cuts a request in half;
        # the endpoint waits for ``inflight`` before it returns.
        session.inflight = asyncio.ensure_future(session.on_frame(frame))
        await asyncio.shield(session.inflight)
