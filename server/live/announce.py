"""Announcing packets: a sent packet to its group exactly once, whatever fails in between.

A send commits the debit and the packet before anything is published (``packets.send_packet``). Then the
packet's ``packet`` event is published with a once-key in the group's slot (``scriptcalls.Once``), and
``red_packets.announced_ms`` is set. If Redis fails between the commit and the publish, the packet stays
unannounced in the database; it is announced

- at once by the sender's retry with the same ``request_id`` (a replay), or
- by a worker (``announce_pending``, every few seconds) once Redis answers again.

The once-key makes every one of these a no-op after the first success, so two of them racing (a hub that
was merely slow, and the worker) still publish one event. It lives as long as the packet can be grabbed
and settled; a packet the database marks announced is never published again.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from redis.exceptions import RedisError

from server.core import Core
from server.errors import RedPacketError
from server.live import events
from server.money import packets, queries
from server.money.ledger import now_ms
from server.money.packets import Packet
from server.store.scriptcalls import Once

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
        "commitment": p.commitment,
    }


def packet_lifetime(core: Core) -> int:
    """How long a packet can be grabbed and settled, in seconds: its once-keys live as long."""
    s = core.settings
    return s.packet_ttl_seconds + s.redis_grace_seconds


def _once(core: Core, p: Packet) -> Once:
    return Once(f"packet:{p.packet_id}", packet_lifetime(core))


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

    await queries.mark_announced(core.db, p.packet_id)
    return offset


async def announce_pending(core: Core, now: int | None = None, limit: int = 500) -> int:
    """Announce the live packets that were saved but never announced (the worker's sweep); returns how
    many were announced now."""
    now = now_ms() if now is None else now
    done = 0
    for pid in await queries.unannounced(core.db, now, created_before=now - WORKER_AFTER_MS, limit=limit):
        p = await packets.load_packet(core, pid)
        if p is not None and await announce_packet(core, _unpublished(p)) is not None:
            done += 1
    if done:
        log.warning("announced %d packet(s) that were saved while Redis was unavailable", done)
    return done


def _unpublished(p: Packet) -> Packet:
    """A packet read back from the database: whether Redis holds it is unknown, so it is put up again."""
    return dataclasses.replace(p, published=False)
