"""The requests a socket may send, one handler each (``HANDLERS``): ``ping``, ``sync``, ``chat``, ``send``,
``grab``, ``open``, ``presence`` (docs/protocol.md). A handler answers at once, returns what to await for
the answer, or a ``Later``; its errors are RedPacketErrors with the protocol's codes. ``Session`` (in
``server.hub.session``) calls them in order, one at a time per socket."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, assert_never

from redpacket_client.protocol import offset_key
from server import errors, text, tracing
from server.errors import InvalidRequest, RedPacketError
from server.hub import protocol
from server.hub.packetcache import Turn, Wait
from server.hub.protocol import Body, Message, field_id
from server.ids import GroupId, PacketId, UserId
from server.live import announce, events
from server.live.botscore import Attempt
from server.money import grabs, packets, queries
from server.money.endpoints import configured
from server.money.grabs import view_dict
from server.store import keys

if TYPE_CHECKING:
    from server.hub.hub import Hub
    from server.hub.session import Session

log = logging.getLogger(__name__)

Answer = Message | Awaitable[Message]


@dataclass(frozen=True)
class Later:
    """An answer that waits for ``turn`` without a task of its own; then ``answer(turn's result)``."""

    turn: asyncio.Future[Turn]
    answer: Callable[[Turn], Answer]


# A handler answers at once (a dict), returns what to await for the answer, or a ``Later``; errors are
# RedPacketErrors.
Handler = Callable[["Session", Message], "Answer | Later"]


def on_ping(s: Session, body: Body) -> Message:
    return {"ts": int(time.time() * 1000)}


async def _open_packets(s: Session, group: GroupId) -> list[Message]:
    """The group's newest 20 packets that can still be grabbed (before expiry, with shares left)."""
    now = int(time.time() * 1000)
    views = []
    for pid in await queries.open_in_group(s.core.db, group, now):
        with contextlib.suppress(RedPacketError):
            view = await grabs.open_packet(s.core, packet_id=pid, group_id=group, user_id=s.conn.user_id)
            if view.remaining > 0 and view.expires_ms > now:
                views.append(view_dict(view))
    return views


def _group_key(raw: object) -> GroupId | None:
    """A sync's group key: the group an integer or a string of digits names, else None (refused as
    not_member)."""
    if isinstance(raw, str) and raw.isascii() and raw.isdigit():
        return GroupId(int(raw))
    return GroupId(raw) if isinstance(raw, int) and not isinstance(raw, bool) else None


async def on_sync(s: Session, body: Body) -> Message:
    """Per group: replay what the client missed since its offset, or the current state when it has none
    or the stream no longer holds the gap. Every event this sync sends (replayed, held since the welcome,
    or come while it ran) goes before this reply, and the reply accounts for them: its ``offset`` is
    never older than one of them, its ``replayed`` counts them."""
    wanted = body.get("groups")
    if not isinstance(wanted, dict):
        raise InvalidRequest(errors.BAD_REQUEST, "groups must map group id to the last offset seen (or null)")
    # Every offset is checked before anything is held or sent: a malformed one refuses the whole sync.
    plan = [(raw, protocol.parse_offset(since)) for raw, since in wanted.items()]
    out: Message = {}
    asked = [(raw, _group_key(raw), since) for raw, since in plan]
    # Each group this socket is in, checked again in the member cache at once (one pipeline): a hub that
    # missed a removal's note does not replay the group to its removed member (``Session.member_now``).
    user = s.conn.user_id
    await s.hub.recheck_members([(g, user) for _, g, _ in asked if g is not None and g in s.conn.groups])
    # The groups this sync releases, with the events it sent each. All stay held until the reply is
    # made: an event that comes while a later group is read is sent with the rest and counted, never
    # slipped in between them and the reply.
    sent: dict[GroupId, int] = {}
    synced: dict[GroupId, tuple[Message, str]] = {}
    try:
        for raw_group, group, since in asked:
            if group is None or group not in s.conn.groups:
                out[str(raw_group)] = {"error": errors.NOT_MEMBER}
                continue
            if s.conn.hold(group):  # live: held again meanwhile, and live again even if this fails
                sent[group] = 0
            entry, latest, replayed = await _sync_group(s, group, since)
            sent[group] = sent.get(group, 0) + replayed
            out[str(group)] = entry
            synced[group] = (entry, latest)
    finally:
        # A group this sync could not read (Redis is down) goes on as before: live if it was, else held
        # until a sync succeeds. Each group read is sent what was held after what it replayed.
        for group in sent:
            sent[group] += s.conn.release(group, s.conn.last.get(group, (0, 0)))
    for group, (entry, latest) in synced.items():
        newest = s.conn.last.get(group, (0, 0))
        if newest > offset_key(latest):
            entry["offset"] = f"{newest[0]}-{newest[1]}"
        if "replayed" in entry:
            entry["replayed"] = sent[group]
    return {"groups": out}


async def _sync_group(s: Session, group: GroupId, since: str | None) -> tuple[Message, str, int]:
    """One group of a sync, held meanwhile: its reply entry, its newest offset, and how many events were
    replayed to this socket (those it already had are not sent again)."""
    latest = await events.latest_offset(s.core, group)
    missed = await events.since(s.core, group, since, s.core.settings.sync_limit) if since else None
    if since is None or missed is None or missed.too_old:
        # What was held since the welcome is sent at the release (a fresh start loses nothing that
        # happened while the client was unsynced); what this socket already had is not sent again.
        return (
            {"offset": latest, "too_old": since is not None, "packets": await _open_packets(s, group)},
            latest,
            0,
        )
    # Never send again what this socket already received: a second sync only adds what is newer.
    s.conn.last[group] = max(offset_key(since), s.conn.last.get(group, (0, 0)))
    replayed = 0
    for offset, kind, data in missed.events:
        key = offset_key(offset)
        if key > s.conn.last[group]:
            s.conn.last[group] = key
            s.conn.send(protocol.event(group, offset, kind, data))
            replayed += 1
    return {"offset": latest, "replayed": replayed, "too_old": False}, latest, replayed


async def on_chat(s: Session, body: Body) -> Message:
    group = await s.member_now(body)
    said = body.get("text")
    if not isinstance(said, str) or not said.strip() or len(said) > protocol.MAX_TEXT_CHARS:
        raise InvalidRequest(errors.TEXT_INVALID, f"text is 1 to {protocol.MAX_TEXT_CHARS} characters")
    if not text.chat_ok(said):
        raise InvalidRequest(
            errors.TEXT_INVALID, "chat may hold line feeds and tabs, no other control characters or overrides"
        )
    offset = await s.hub.publish(group, "chat", {"user": s.conn.user_id, "text": said})
    return {"offset": offset}


async def on_send(s: Session, body: Body) -> Message:
    group = s.member_of(body)
    request_id = body.get("request_id")
    if request_id is not None and not isinstance(request_id, str):
        raise InvalidRequest(errors.BAD_REQUEST, "request_id must be a string")
    return await send(s.hub, body, sender_id=s.conn.user_id, group_id=group, request_id=request_id)


async def send(
    hub: Hub,
    body: Body,
    *,
    sender_id: UserId,
    group_id: GroupId,
    request_id: str | None,
    system: bool = False,
) -> Message:
    """A send from a request's fields (a user's socket, or the chat backend's
    ``POST /api/service/packets``): paid for and saved with the backend's say (``server.hub.hooks``),
    then announced in its room now — or, offset null, by a retry or a worker once Redis is back; the
    send's answer. Tracing: a span of the send, its packet's id set once known, kept for the webhook
    delivery of its ``packet.sent`` to join."""
    db: dict[str, Any] = {"db.system": hub.core.db.dialect.name}
    with tracing.maybe("send", "server", root=True, group_id=group_id, user_id=sender_id) as span:
        with tracing.maybe("ledger send transaction", "client", **db):
            p = await packets.send_packet(
                hub.core,
                sender_id=sender_id,
                group_id=group_id,
                kind=body.get("kind", "lucky"),
                total=body.get("total"),
                count=body.get("count"),
                greeting=body.get("greeting", ""),
                target_user_id=body.get("target"),
                request_id=request_id,
                system=system,
                approve=hub.hooks.approve_send,
            )
        if span is not None:
            span.set_attribute("redpacket.packet_id", p.packet_id)
            if configured(hub.core.settings):  # for the webhook delivery of its packet.sent to join
                await tracing.keep(hub.core.redis, keys.trace_of("send", p.packet_id))
        hub.packet_cache.mark_known(group_id=p.group_id, packet_id=p.packet_id)
        with tracing.maybe("redis publish", "client", packet_id=p.packet_id):
            offset = await announce.announce_packet(hub.core, p)
    if offset is not None and not p.replay:
        hub.metrics.events_published.inc()
    return {**announce.packet_event(p), "offset": offset, "replay": p.replay}


def on_grab(s: Session, body: Body) -> Answer | Later:
    started = time.perf_counter()
    metrics = s.hub.metrics
    kp = s.hub.packet_cache
    try:
        group = s.member_of(body)
        packet_id = PacketId(field_id(body, "packet", errors.PACKET_NOT_FOUND))
        _record_attempt(s, group_id=group, packet_id=packet_id)
    except RedPacketError as e:
        metrics.grab_outcomes.labels(e.code).inc()
        raise
    # A packet this hub knows to be closed (or no packet at all) is answered from memory.
    _refuse_if_known(s, group_id=group, packet_id=packet_id)

    # In a storm, grabs beyond the shares left wait their turn (no task each); most are then answered
    # from memory when the packet empties.
    match kp.admit(packet_id):
        case Turn.GO:
            return _go(s, started, group_id=group, packet_id=packet_id)
        case Wait(waiting):

            def answer(turn: Turn) -> Answer:  # (made for a waiting grab only: not on the common path)
                match turn:
                    case Turn.GO:
                        pass
                    case Turn.CLOSED:
                        _refuse_if_known(s, started, group_id=group, packet_id=packet_id)
                        # A winner (only Redis answers their share), or the state could not be read.
                        kp.admit_anyway(packet_id)
                    case _:
                        assert_never(turn)
                return _go(s, started, group_id=group, packet_id=packet_id)

            return Later(waiting, answer)
        case never:
            assert_never(never)


def _refuse_if_known(
    s: Session, started: float | None = None, *, group_id: GroupId, packet_id: PacketId
) -> None:
    refusal = s.hub.packet_cache.refusal(group_id=group_id, packet_id=packet_id, user_id=s.conn.user_id)
    if refusal is None:
        return
    metrics = s.hub.metrics
    metrics.grab_outcomes.labels(_OUTCOMES.get(refusal, refusal)).inc()
    metrics.grabs_answered_locally.inc()
    if started is not None:
        metrics.grab_seconds.observe(time.perf_counter() - started)
    raise grabs.refusal_error(refusal)


_OUTCOMES = {errors.PACKET_EMPTY: "empty", errors.PACKET_EXPIRED: "expired"}


def _go(s: Session, started: float, *, group_id: GroupId, packet_id: PacketId) -> Answer:
    """The grab in Redis, in a span of its own when tracing (``server.tracing``)."""
    if tracing.ON and tracing.draw():  # (a move not drawn: no span at all)
        return _traced(
            _grab(s, started, group_id=group_id, packet_id=packet_id), "grab", s, group_id, packet_id
        )
    return _grab(s, started, group_id=group_id, packet_id=packet_id)


async def _traced(
    work: Awaitable[Message], name: str, s: Session, group_id: GroupId, packet_id: PacketId
) -> Message:
    with tracing.span(name, "server", packet_id=packet_id, group_id=group_id, user_id=s.conn.user_id) as span:
        try:
            answer = await work
        except RedPacketError as e:
            span.set_attribute("redpacket.outcome", e.code)
            raise
        span.set_attribute("redpacket.outcome", str(answer.get("outcome", "")))
        return answer


async def _grab(s: Session, started: float, *, group_id: GroupId, packet_id: PacketId) -> Message:
    """The grab in Redis, with a slot of the packet's flight (``PacketCache.admit``) already taken."""
    metrics = s.hub.metrics
    kp = s.hub.packet_cache
    remaining: int | None = None
    try:
        r = await grabs.grab(
            s.core, packet_id=packet_id, group_id=group_id, user_id=s.conn.user_id, gate=True
        )
        remaining = r.remaining
        if remaining == 0:
            kp.mark_closed(group_id=group_id, packet_id=packet_id)
    except RedPacketError as e:
        metrics.grab_outcomes.labels(_OUTCOMES.get(e.code, e.code)).inc()
        if e.code in _OUTCOMES:
            remaining = 0
            kp.mark_closed(group_id=group_id, packet_id=packet_id)
        elif e.code == errors.PACKET_NOT_FOUND:
            kp.mark_unknown(group_id=group_id, packet_id=packet_id)
        raise
    finally:
        kp.answered(packet_id, remaining)
        metrics.grab_seconds.observe(time.perf_counter() - started)
    metrics.grab_outcomes.labels(r.outcome).inc()
    if r.outcome == "won":
        s.hub.announcer.grabbed(r.grab, r.remaining, group_id=group_id, packet_id=packet_id)
        if r.remaining == 0:
            # Exactly one grab empties a packet: it announces the result, after the grabs.
            s.hub.spawn(
                s.hub.announcer.finished(group_id=group_id, packet_id=packet_id, viewer_id=s.conn.user_id)
            )
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


def _record_attempt(s: Session, *, group_id: GroupId, packet_id: PacketId) -> None:
    """For the bot detector: who grabbed what, how long after this socket was shown it."""
    shown = s.conn.announced.get(packet_id)
    now = int(time.time() * 1000)
    reaction = None if shown is None else now - shown
    attempt = Attempt(
        user=s.conn.user_id,
        group=group_id,
        packet=packet_id,
        reaction_ms=reaction,
        device=s.conn.device,
        ms=now,
    )
    s.hub.attempts.record(attempt)


async def on_open(s: Session, body: Body) -> Message:
    group = await s.member_now(body)
    packet_id = PacketId(field_id(body, "packet", errors.PACKET_NOT_FOUND))
    return view_dict(
        await grabs.open_packet(s.core, packet_id=packet_id, group_id=group, user_id=s.conn.user_id)
    )


async def on_presence(s: Session, body: Body) -> Message:
    group = await s.member_now(body)
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
