"""``server.hub.packetcache`` in-process: how many grabs of a packet go to Redis at once, the answers a hub
gives from memory for closed packets and ids that are no packet. Redis is a fake that answers the three
reads of a packet's final state; the clock is the test's."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from server import errors
from server.core import Core
from server.hub import packetcache
from server.hub.packetcache import (
    FIRST_FLIGHT,
    MIN_FLIGHT,
    UNKNOWN_SECONDS,
    Closed,
    PacketCache,
    Turn,
    Wait,
    local_refusal,
)
from server.store import keys
from tests.unit.fakes import Clock, until

GO, CLOSED = Turn.GO, Turn.CLOSED
GROUP = 5
PACKET = 900
WINNER = 11
LATE = 12


class FakeRedis:
    """A packet's keys as a pipeline answers them (``hmget``, ``llen``, ``hkeys``)."""

    def __init__(self) -> None:
        self.hashes: dict[str, dict[bytes, bytes]] = {}
        self.lists: dict[str, list[bytes]] = {}

    def hmget(self, key: str, fields: list[str]) -> list[bytes | None]:
        h = self.hashes.get(key, {})
        return [h.get(f.encode()) for f in fields]

    def llen(self, key: str) -> int:
        return len(self.lists.get(key, []))

    def hkeys(self, key: str) -> list[bytes]:
        return list(self.hashes.get(key, {}))


@dataclass
class FakeBatcher:
    """``Batcher.call``: runs the queued command on the fake. ``gate`` holds answers back while clear;
    ``down`` answers every call with a lost connection; ``on_read`` runs as each call is answered."""

    redis: FakeRedis
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    down: bool = False
    reads: int = 0
    on_read: Callable[[], None] | None = None

    def __post_init__(self) -> None:
        self.gate.set()

    async def call(self, queue: Callable[[FakeRedis], Any], key: str, durable: bool = False) -> Any:
        await self.gate.wait()
        self.reads += 1
        if self.down:
            raise RedisConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")
        if self.on_read is not None:
            self.on_read()
        return queue(self.redis)


@dataclass
class Rig:
    cache: PacketCache
    redis: FakeRedis
    batcher: FakeBatcher
    repairs: SimpleNamespace
    clock: Clock

    def packet(
        self,
        *,
        group: int = GROUP,
        packet_id: int = PACKET,
        left: int = 0,
        winners: tuple[int, ...] = (WINNER,),
        target: int | None = None,
        closed: bool = False,
        expires_in_ms: int = 60_000,
        stored_group: int | None = None,
    ) -> None:
        """Write a packet's final state where the grab script keeps it."""
        meta, shares, grabs, _ = keys.packet_keys(group_id=group, packet_id=packet_id)
        self.redis.hashes[meta] = {
            b"group": str(group if stored_group is None else stored_group).encode(),
            b"expires_ms": str(self.clock.now_ms() + expires_in_ms).encode(),
            b"closed": b"1" if closed else b"0",
            **({b"target": str(target).encode()} if target is not None else {}),
        }
        self.redis.lists[shares] = [b"1:100"] * left
        self.redis.hashes[grabs] = {str(u).encode(): b"1:100:0" for u in winners}

    def fill(self, packet_id: int = PACKET, n: int = FIRST_FLIGHT) -> None:
        """``n`` grabs of the packet sent to Redis at once."""
        for _ in range(n):
            assert self.cache.admit(packet_id=packet_id) is Turn.GO

    def wait(self, n: int, packet_id: int = PACKET) -> list[asyncio.Future[Turn]]:
        """``n`` grabs that must wait their turn."""
        admitted = [self.cache.admit(packet_id=packet_id) for _ in range(n)]
        turns = [a.turn for a in admitted if isinstance(a, Wait)]
        assert len(turns) == n and not any(t.done() for t in turns)
        return turns

    def refusal(self, user: int, *, group_id: int = GROUP, packet_id: int = PACKET) -> str | None:
        return self.cache.refusal(group_id=group_id, packet_id=packet_id, user_id=user)


def make_rig(clock: Clock, remember: int = 10_000) -> Rig:
    redis = FakeRedis()
    batcher = FakeBatcher(redis)
    repairs = SimpleNamespace(generation=1)
    core = cast(Core, SimpleNamespace(batcher=batcher, repairs=repairs))
    return Rig(PacketCache(core, remember=remember), redis, batcher, repairs, clock)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(packetcache, "time", c)
    return c


@pytest.fixture
def rig(clock: Clock) -> Rig:
    return make_rig(clock)


async def settled(turns: list[asyncio.Future[Turn]]) -> list[Turn]:
    return list(await asyncio.wait_for(asyncio.gather(*turns), 5))


# -- admission: how many grabs of a packet go to Redis at once -------------------------------------------


async def test_the_first_flight_goes_at_once_and_the_rest_wait_in_order(rig: Rig) -> None:
    rig.fill()
    waiting = rig.wait(3)
    assert rig.cache.admit(packet_id=PACKET + 1) is Turn.GO  # another packet has its own flight
    assert rig.cache.hottest() == (2, 3, 0)  # shares left not known before an answer
    rig.cache.answered(packet_id=PACKET, remaining=None)  # a slot freed, the limit unchanged
    assert [t.done() for t in waiting] == [True, False, False]
    rig.cache.answered(packet_id=PACKET, remaining=FIRST_FLIGHT + 1)  # many left: the limit follows
    assert await settled(waiting) == [GO, GO, GO]
    assert rig.cache.hottest() == (2, 0, FIRST_FLIGHT + 1)


async def test_with_few_shares_left_min_flight_grabs_go_at_once_never_fewer(rig: Rig) -> None:
    rig.fill()
    waiting = rig.wait(20)
    went = []
    for _ in range(FIRST_FLIGHT):
        rig.cache.answered(packet_id=PACKET, remaining=1)  # one share left: still MIN_FLIGHT at once
        went.append(sum(t.done() for t in waiting))
    # Nothing goes until fewer than MIN_FLIGHT are in flight; then one goes per answer, in order.
    assert went[FIRST_FLIGHT - MIN_FLIGHT - 1] == 0 and went[FIRST_FLIGHT - MIN_FLIGHT] == 1
    assert [t.done() for t in waiting] == [True] * MIN_FLIGHT + [False] * (20 - MIN_FLIGHT)
    assert rig.cache.hottest() == (1, 20 - MIN_FLIGHT, 1)


async def test_a_waiting_grab_given_up_passes_its_turn_to_the_next(rig: Rig) -> None:
    rig.fill()
    gone, next_one = rig.wait(2)
    gone.cancel()  # its socket closed while it waited
    rig.cache.answered(packet_id=PACKET, remaining=None)
    assert await settled([next_one]) == [GO]
    assert rig.cache.hottest() == (1, 0, 0)


async def test_an_answer_of_empty_with_no_final_state_coming_keeps_grabs_moving(rig: Rig) -> None:
    rig.fill()
    (waiting,) = rig.wait(1)
    for _ in range(FIRST_FLIGHT - 1):
        rig.cache.answered(packet_id=PACKET, remaining=0)
        assert not waiting.done()  # empty: nothing more goes while grabs are still in flight
    rig.cache.answered(packet_id=PACKET, remaining=0)  # the last: nobody will answer it from memory
    assert await settled([waiting]) == [GO]


async def test_a_packet_done_with_leaves_no_flight_behind(rig: Rig) -> None:
    rig.cache.answered(packet_id=PACKET, remaining=3)  # no grab of it was sent: nothing to do
    rig.fill(n=2)
    rig.cache.answered(packet_id=PACKET, remaining=5)
    rig.cache.answered(packet_id=PACKET, remaining=4)
    assert rig.cache.hottest() == (0, 0, 0) and rig.cache.flights == {}


# -- a closed packet: its final state read once, waiting grabs answered from it ---------------------------


async def test_waiting_grabs_of_an_emptied_packet_are_answered_from_its_final_state(rig: Rig) -> None:
    rig.packet(left=0)
    rig.batcher.gate.clear()  # the final state is on its way
    rig.fill()
    waiting = rig.wait(3)
    rig.cache.mark_closed(group_id=GROUP, packet_id=PACKET)
    rig.cache.answered(packet_id=PACKET, remaining=0)
    assert not any(t.done() for t in waiting)  # they wait for the final state, not for Redis
    rig.batcher.gate.set()
    assert await settled(waiting) == [CLOSED, CLOSED, CLOSED]  # ask refusal(), not Redis
    assert rig.refusal(LATE) == errors.PACKET_EMPTY
    assert rig.refusal(WINNER) is None  # a winner's answer is their share: only Redis has it
    rig.cache.admit_anyway(packet_id=PACKET)
    for _ in range(FIRST_FLIGHT):
        rig.cache.answered(packet_id=PACKET, remaining=0)
    assert rig.cache.flights == {}
    reads = rig.batcher.reads
    rig.cache.mark_closed(group_id=GROUP, packet_id=PACKET)  # seen closed again: not read again
    assert rig.batcher.reads == reads == 3


async def test_once_the_final_state_is_known_an_empty_answer_refuses_the_waiting_at_once(rig: Rig) -> None:
    rig.packet(left=0)
    rig.cache.mark_closed(group_id=GROUP, packet_id=PACKET)
    await until(lambda: rig.refusal(LATE) is not None)
    rig.fill()
    waiting = rig.wait(2)
    rig.cache.answered(packet_id=PACKET, remaining=0)
    assert [t.result() for t in waiting] == [CLOSED, CLOSED]  # (result() raises if one still waits)


async def test_waiting_grabs_go_to_redis_when_the_final_state_cannot_be_read(rig: Rig) -> None:
    rig.packet(left=0)
    rig.batcher.down = True
    rig.fill()
    waiting = rig.wait(2)
    rig.cache.mark_closed(group_id=GROUP, packet_id=PACKET)
    rig.cache.answered(packet_id=PACKET, remaining=0)
    assert await settled(waiting) == [GO, GO]
    assert rig.refusal(LATE) is None


@pytest.mark.parametrize(
    ("packet", "later_s", "user", "code"),
    [
        ({"left": 0}, 0, LATE, errors.PACKET_EMPTY),
        ({"left": 0}, 61, LATE, errors.PACKET_EXPIRED),  # expiry outranks emptiness
        ({"left": 2, "closed": True}, 0, LATE, errors.PACKET_EXPIRED),  # settled or refunded early
        ({"left": 0, "target": 7}, 0, LATE, errors.NOT_TARGET),
        ({"left": 0, "target": LATE}, 0, LATE, errors.PACKET_EMPTY),
        ({"left": 0}, 0, WINNER, None),
        ({"left": 0}, 61, WINNER, None),
    ],
)
async def test_a_closed_packet_is_refused_locally_as_the_grab_script_would(
    rig: Rig, packet: dict[str, Any], later_s: float, user: int, code: str | None
) -> None:
    rig.packet(**packet)
    rig.cache.mark_closed(group_id=GROUP, packet_id=PACKET)
    await until(lambda: PACKET in rig.cache.closed)
    rig.clock.advance(later_s)
    assert rig.refusal(user) == code
    assert (
        rig.refusal(user, group_id=GROUP + 1) is None
    )  # asked in another group: Redis says "no such packet"


async def test_a_packet_still_open_or_of_another_group_is_not_kept(rig: Rig) -> None:
    for what in ({"left": 2}, {"left": 0, "stored_group": GROUP + 1}):
        rig.packet(**what)
        rig.fill()
        waiting = rig.wait(1)
        rig.cache.mark_closed(group_id=GROUP, packet_id=PACKET)
        rig.cache.answered(packet_id=PACKET, remaining=0)
        assert await settled(waiting) == [GO], what  # nothing to answer from: on to Redis
        assert rig.refusal(LATE) is None, what
        rig.cache.flights.clear()


def test_every_code_a_closed_packet_can_be_answered_with() -> None:
    c = Closed(
        group=GROUP,
        winners=frozenset({WINNER}),
        expires_ms=10_000,
        target=None,
        closed=False,
        empty=True,
        generation=1,
    )

    def answer(closed: Closed, *, group: int = GROUP, user: int = LATE, now_ms: int = 5_000) -> str | None:
        return local_refusal(closed, group_id=group, user_id=user, now_ms=now_ms)

    assert answer(c) == errors.PACKET_EMPTY
    assert answer(c, now_ms=9_999) == errors.PACKET_EMPTY
    assert answer(c, now_ms=10_000) == errors.PACKET_EXPIRED
    assert answer(dataclasses.replace(c, closed=True, empty=False)) == errors.PACKET_EXPIRED
    assert answer(dataclasses.replace(c, target=7)) == errors.NOT_TARGET
    assert answer(dataclasses.replace(c, target=7), now_ms=10_000) == errors.PACKET_EXPIRED
    assert answer(dataclasses.replace(c, target=LATE)) == errors.PACKET_EMPTY
    assert answer(dataclasses.replace(c, empty=False)) is None  # shares left: Redis decides
    assert answer(c, user=WINNER) is None
    assert answer(c, user=WINNER, now_ms=10_000) is None
    assert answer(c, group=GROUP + 1) is None


# -- what Redis may have lost: a new generation forgets what was read -------------------------------------


async def test_a_new_generation_forgets_what_was_read_and_the_packet_is_read_again(rig: Rig) -> None:
    rig.packet(left=0)
    rig.cache.mark_closed(group_id=GROUP, packet_id=PACKET)
    await until(lambda: rig.refusal(LATE) is not None)
    rig.repairs.generation += 1  # Redis restarted or failed over: shares may be back
    assert rig.refusal(LATE) is None
    rig.repairs.generation -= 1  # forgotten, not merely hidden
    assert rig.refusal(LATE) is None and PACKET not in rig.cache.closed
    rig.repairs.generation += 1
    rig.cache.mark_closed(group_id=GROUP, packet_id=PACKET)
    await until(lambda: rig.refusal(LATE) is not None)
    assert rig.refusal(LATE) == errors.PACKET_EMPTY and rig.batcher.reads == 6


async def test_a_read_the_generation_moved_under_is_not_kept(rig: Rig) -> None:
    rig.packet(left=0)

    def failover() -> None:
        rig.repairs.generation = 2

    rig.batcher.on_read = failover
    rig.fill()
    waiting = rig.wait(1)
    rig.cache.mark_closed(group_id=GROUP, packet_id=PACKET)
    rig.cache.answered(packet_id=PACKET, remaining=0)
    assert await settled(waiting) == [GO]
    assert rig.refusal(LATE) is None and rig.cache.closed == {}


async def test_the_closed_packets_kept_are_bounded_oldest_first(clock: Clock) -> None:
    rig = make_rig(clock, remember=2)
    for packet_id in (1, 2, 3):
        rig.packet(packet_id=packet_id, left=0)
        rig.cache.mark_closed(group_id=GROUP, packet_id=packet_id)
        await until(lambda p=packet_id: p in rig.cache.closed)
    assert [rig.refusal(LATE, packet_id=p) for p in (1, 2, 3)] == [
        None,
        errors.PACKET_EMPTY,
        errors.PACKET_EMPTY,
    ]
    assert len(rig.cache.closed) == 2


# -- ids that are no packet -------------------------------------------------------------------------------


def test_an_unknown_id_is_refused_for_unknown_seconds_in_its_group_only(rig: Rig) -> None:
    assert rig.refusal(LATE) is None  # never looked up: the database is asked
    rig.cache.mark_unknown(group_id=GROUP, packet_id=PACKET)
    assert rig.refusal(LATE) == errors.PACKET_NOT_FOUND
    assert rig.refusal(LATE, group_id=GROUP + 1) is None  # the same id in another group is another question
    rig.clock.advance(UNKNOWN_SECONDS)
    assert rig.refusal(LATE) == errors.PACKET_NOT_FOUND
    rig.clock.advance(0.001)
    assert rig.refusal(LATE) is None
    assert len(rig.cache.unknown) == 0  # forgotten, not kept expired


def test_unknown_ids_are_bounded_and_the_least_recent_is_forgotten_first(clock: Clock) -> None:
    rig = make_rig(clock, remember=3)
    for packet_id in range(1, 1_000):
        rig.cache.mark_unknown(group_id=GROUP, packet_id=packet_id)
        assert len(rig.cache.unknown) <= 3
    found = {p for p in range(1, 1_000) if rig.refusal(LATE, packet_id=p) == errors.PACKET_NOT_FOUND}
    assert found == {997, 998, 999}
    rig = make_rig(clock, remember=3)
    for packet_id in (1, 2, 3):
        rig.cache.mark_unknown(group_id=GROUP, packet_id=packet_id)
    rig.cache.mark_unknown(group_id=GROUP, packet_id=1)  # seen again: the most recent now
    rig.cache.mark_unknown(group_id=GROUP, packet_id=4)
    assert [rig.refusal(LATE, packet_id=p) is not None for p in (1, 2, 3, 4)] == [True, False, True, True]


def test_an_announced_packet_is_no_longer_unknown(rig: Rig) -> None:
    rig.cache.mark_unknown(group_id=GROUP, packet_id=PACKET)
    rig.cache.mark_unknown(group_id=GROUP + 1, packet_id=PACKET)
    rig.cache.mark_known(group_id=GROUP, packet_id=PACKET)
    assert rig.refusal(LATE) is None
    assert rig.refusal(LATE, group_id=GROUP + 1) == errors.PACKET_NOT_FOUND
    rig.cache.mark_known(group_id=GROUP, packet_id=PACKET + 1)  # never unknown: nothing to forget


def test_a_local_answer_is_the_one_the_grab_script_gives() -> None:
    c = Closed(
        group=1,
        winners=frozenset({7}),
        expires_ms=10_000,
        target=None,
        closed=False,
        empty=True,
        generation=1,
    )
    assert local_refusal(c, 5_000, group_id=1, user_id=8) == "packet_empty"
    assert local_refusal(c, 5_000, group_id=1, user_id=7) is None  # a winner: only Redis answers their share
    assert (
        local_refusal(c, 5_000, group_id=2, user_id=8) is None
    )  # another group: Redis answers "no such packet"
    assert local_refusal(c, 10_000, group_id=1, user_id=8) == "packet_expired"
    assert (
        local_refusal(dataclasses.replace(c, closed=True), 5_000, group_id=1, user_id=8) == "packet_expired"
    )
    exclusive = dataclasses.replace(c, target=9)
    assert local_refusal(exclusive, 5_000, group_id=1, user_id=8) == "not_target"
    assert local_refusal(dataclasses.replace(c, empty=False), 5_000, group_id=1, user_id=8) is None


async def test_the_hot_packet_gauges_read_the_storm_admission() -> None:
    from typing import cast

    from server.core import Core
    from server.hub.packetcache import PacketCache

    k = PacketCache(cast(Core, None))
    assert k.hottest() == (0, 0, 0)
    monkey_first = packetcache.FIRST_FLIGHT
    try:
        packetcache.FIRST_FLIGHT = 2
        assert k.admit(7) is Turn.GO and k.admit(7) is Turn.GO
        waiting = [k.admit(7), k.admit(7), k.admit(7)]
        assert k.admit(8) is Turn.GO
        assert k.hottest() == (2, 3, 0)  # nothing has landed yet: shares left unknown
        k.answered(7, 40)  # 40 left: every waiting grab goes
        assert all(isinstance(w, Wait) and w.turn.result() is Turn.GO for w in waiting)
        assert k.hottest() == (2, 0, 40)
    finally:
        packetcache.FIRST_FLIGHT = monkey_first
