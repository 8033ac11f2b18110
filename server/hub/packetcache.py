"""What a hub knows of packets without asking Redis: the closed ones, and ids that are no packet.

In a storm on a 1,000-share packet in a 10,000-member room, 9,000 grabs are answered ``packet_empty``.
Once a hub has seen a packet closed — its own grab took the last share, Redis answered empty or expired,
or the room's ``finished`` event came — it reads the packet's final state from Redis once (who won,
when it expires, whom it is for) and answers later grabs of it by anyone *not* among the winners
itself, in the order the grab script decides (``local_refusal``). Winners still go to Redis: their
answer is their share (``already``), which waits for durability like any grab.

That answer is right as long as Redis has not lost writes: what was read belongs to one Redis
*generation* (``server.store.repair``), and is not used once the generation has moved (a restart or a
failover may have put shares back).

While a packet is being grabbed, a hub sends Redis at most about as many grabs of it at once as it has
shares left: the rest wait in order. When it empties, the waiting grabs are answered from its final state
as above, instead of 9,000 script calls that can only say "empty". The admission, between
``server.hub.requests.on_grab``, ``server.hub.session.Session`` and this module: a grab asks ``admit``,
which answers ``Turn.GO`` (a slot is taken for it) or ``Wait``. A waiting grab costs no task: its socket's
session parks the request on the ``Wait``'s future (``requests.Later``; the socket's later frames wait
behind it), which resolves in order with ``Turn.GO`` when a slot frees — or when the final state cannot be
read — and ``Turn.CLOSED`` when the packet closed meanwhile: then the grab is answered from ``refusal``,
unless only Redis can answer it (a winner's own share), when it goes anyway (``admit_anyway``). Every grab
that went to Redis calls ``answered`` once, whatever came back, which frees its slot.

A grab of a packet id Redis does not know costs a database read (is it a live packet Redis lost?).
Ids found to be no packet of the group are remembered for ``UNKNOWN_SECONDS`` (at most
``remember`` of them), and forgotten at once when the group announces a packet with that id.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Literal

from server import errors
from server.core import Core
from server.ids import GroupId, PacketId, UserId
from server.store import keys

UNKNOWN_SECONDS = 30.0
# Grabs of one packet in flight to Redis from this hub: at first, and never fewer while it has shares.
FIRST_FLIGHT = 64
MIN_FLIGHT = 8


class Turn(enum.Enum):
    """A grab's turn to go to Redis (``PacketCache.admit``)."""

    GO = "go"  # a slot is taken for it: send it, then call ``answered``
    CLOSED = "closed"  # the packet closed while it waited: answer from ``refusal`` (else ``admit_anyway``)


@dataclass(frozen=True, slots=True)
class Wait:
    """No slot now: ``turn`` resolves, in the order grabs came, with a ``Turn``."""

    turn: asyncio.Future[Turn]


class Flight:
    """The grabs of one packet this hub has sent to Redis and not yet had answered, and those waiting."""

    def __init__(self) -> None:
        self.inflight = 0
        self.limit = FIRST_FLIGHT
        self.waiting: deque[asyncio.Future[Turn]] = deque()
        self.remaining: int | None = None  # shares left, as the last answer from Redis said


@dataclass(frozen=True)
class Closed:
    """A packet's final state, read once it could no longer be won."""

    group: GroupId
    winners: frozenset[UserId]
    expires_ms: int
    target: UserId | None
    closed: bool  # settled or refunded before its expiry
    empty: bool
    generation: int


def local_refusal(c: Closed, now_ms: int, *, group_id: GroupId, user_id: UserId) -> str | None:
    """The error code the grab script would answer ``user_id`` for this closed packet, or None when only
    Redis can answer (a winner's own share, or a packet of another group)."""
    if c.group != group_id or user_id in c.winners:
        return None
    if c.closed or now_ms >= c.expires_ms:
        return errors.PACKET_EXPIRED
    if c.target is not None and c.target != user_id:
        return errors.NOT_TARGET
    if c.empty:
        return errors.PACKET_EMPTY
    return None


class PacketCache:
    def __init__(self, core: Core, remember: int = 10_000) -> None:
        self.core = core
        self.remember = remember
        self.closed: OrderedDict[PacketId, Closed] = OrderedDict()
        self.unknown: OrderedDict[tuple[GroupId, PacketId], float] = OrderedDict()
        self._loading: dict[PacketId, asyncio.Task[None]] = {}
        self.flights: dict[PacketId, Flight] = {}

    # -- how many grabs of a packet go to Redis at once ------------------------------------------------

    def admit(self, packet_id: PacketId) -> Literal[Turn.GO] | Wait:
        """A slot to send a grab of this packet to Redis: ``Turn.GO`` now, or ``Wait`` for its turn."""
        flight = self._flight(packet_id)
        if flight.inflight < flight.limit and not flight.waiting:
            flight.inflight += 1
            return Turn.GO
        turn: asyncio.Future[Turn] = asyncio.get_running_loop().create_future()
        flight.waiting.append(turn)
        return Wait(turn)

    def admit_anyway(self, packet_id: PacketId) -> None:
        """A grab sent to Redis without a slot of its own (its turn said ``Turn.CLOSED``)."""
        self._flight(packet_id).inflight += 1

    def _flight(self, packet_id: PacketId) -> Flight:
        flight = self.flights.get(packet_id)
        if flight is None:
            flight = self.flights[packet_id] = Flight()
        return flight

    def answered(self, packet_id: PacketId, remaining: int | None) -> None:
        """A grab sent to Redis was answered: ``remaining`` shares are left (0 when it answered empty or
        expired; None when it did not say). Lets waiting grabs go while shares are left."""
        flight = self.flights.get(packet_id)
        if flight is None:
            return
        flight.inflight -= 1
        if remaining is not None:
            flight.remaining = remaining
            flight.limit = max(MIN_FLIGHT, remaining) if remaining > 0 else 0
        if remaining == 0 and packet_id in self.closed:
            self._release(packet_id, True)
            return
        if remaining == 0 and packet_id in self._loading:
            return  # the waiting grabs are answered when the final state is read (``_release``)
        if flight.limit == 0 and flight.inflight == 0:
            flight.limit = MIN_FLIGHT  # nothing in flight and no final state coming: keep grabs moving
        while flight.waiting and flight.inflight < flight.limit:
            turn = flight.waiting.popleft()
            if not turn.done():
                flight.inflight += 1
                turn.set_result(Turn.GO)
        if not flight.waiting and flight.inflight == 0:
            del self.flights[packet_id]

    def _release(self, packet_id: PacketId, closed: bool) -> None:
        """The final state was read (``closed``) or could not be: every waiting grab goes on."""
        flight = self.flights.get(packet_id)
        if flight is None:
            return
        if not closed and flight.limit == 0:
            flight.limit = MIN_FLIGHT
        while flight.waiting:
            turn = flight.waiting.popleft()
            if turn.done():
                continue
            if closed:
                turn.set_result(Turn.CLOSED)
            else:
                flight.inflight += 1
                turn.set_result(Turn.GO)
        if flight.inflight == 0:
            del self.flights[packet_id]

    def hottest(self) -> tuple[int, int, int]:
        """(packets with grabs at Redis or waiting here, grabs waiting here, shares left of the packet
        with the most grabs on the go — the hot key the seeds watch), for the metrics."""
        if not self.flights:
            return 0, 0, 0
        hot = max(self.flights.values(), key=lambda f: f.inflight + len(f.waiting))
        waiting = sum(len(f.waiting) for f in self.flights.values())
        return len(self.flights), waiting, hot.remaining or 0

    def refusal(self, *, group_id: GroupId, packet_id: PacketId, user_id: UserId) -> str | None:
        """The grab's answer if this hub can give it without Redis, else None."""
        c = self.closed.get(packet_id)
        if c is not None:
            if c.generation != self.core.repairs.generation:
                del self.closed[packet_id]
                return None
            code = local_refusal(c, int(time.time() * 1000), group_id=group_id, user_id=user_id)
        else:
            until = self.unknown.get((group_id, packet_id))
            if until is None:
                return None
            if until < time.monotonic():
                del self.unknown[(group_id, packet_id)]
                return None
            code = errors.PACKET_NOT_FOUND
        return code

    def mark_closed(self, *, group_id: GroupId, packet_id: PacketId) -> None:
        """The packet can no longer be won: read its final state once, in the background."""
        if packet_id in self.closed or packet_id in self._loading:
            return
        self._loading[packet_id] = asyncio.get_running_loop().create_task(
            self._load(group_id=group_id, packet_id=packet_id)
        )

    def mark_unknown(self, *, group_id: GroupId, packet_id: PacketId) -> None:
        self.unknown[(group_id, packet_id)] = time.monotonic() + UNKNOWN_SECONDS
        self.unknown.move_to_end((group_id, packet_id))
        while len(self.unknown) > self.remember:
            self.unknown.popitem(last=False)

    def mark_known(self, *, group_id: GroupId, packet_id: PacketId) -> None:
        """A packet was announced (or sent here): its id is no longer unknown."""
        self.unknown.pop((group_id, packet_id), None)

    async def _load(self, *, group_id: GroupId, packet_id: PacketId) -> None:
        closed = False
        try:
            closed = await self._read(group_id=group_id, packet_id=packet_id)
        finally:
            self._loading.pop(packet_id, None)
            self._release(packet_id, closed)

    async def _read(self, *, group_id: GroupId, packet_id: PacketId) -> bool:
        generation = self.core.repairs.generation
        meta_key, shares_key, grabs_key, _ = keys.packet_keys(group_id=group_id, packet_id=packet_id)
        call = self.core.batcher.call
        try:
            meta, left, winners = await asyncio.gather(
                call(lambda p: p.hmget(meta_key, ["group", "expires_ms", "target", "closed"]), meta_key),
                call(lambda p: p.llen(shares_key), shares_key),
                call(lambda p: p.hkeys(grabs_key), grabs_key),
            )
        except Exception:
            return False  # Redis is away: grabs go to Redis, which answers them when it is back
        if meta[0] is None or int(meta[0]) != group_id or generation != self.core.repairs.generation:
            return False
        expires_ms = int(meta[1])
        c = Closed(
            group=group_id,
            winners=frozenset(UserId(int(u)) for u in winners),
            expires_ms=expires_ms,
            target=UserId(int(meta[2])) if meta[2] else None,
            closed=meta[3] == b"1",
            empty=int(left) == 0,
            generation=generation,
        )
        if not (c.empty or c.closed or int(time.time() * 1000) >= expires_ms):
            return False  # still open (a repair put shares back): nothing to answer locally
        self.closed[packet_id] = c
        while len(self.closed) > self.remember:
            self.closed.popitem(last=False)
        return True
