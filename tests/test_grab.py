"""Grab and open against the real Redis: atomic, idempotent, never more than the total."""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter

import pytest

from server import errors
from server.core import Core
from server.errors import RedPacketError
from server.money import grabs, groups, ledger, packets
from server.money.membership import Membership
from server.store import keys
from server.store.batch import Batcher
from server.store.scriptcalls import FillMembersCall, run_alone
from tests.conftest import block, bulk_users, make_world, outbox


async def _grab_code(core: Core, packet_id: int, group_id: int, user: int, gate: bool = False) -> str:
    try:
        return (
            await grabs.grab(core, packet_id=packet_id, group_id=group_id, user_id=user, gate=gate)
        ).outcome
    except RedPacketError as e:
        return e.code


def unbatched(core: Core) -> Core:
    """The same core with every Redis call sent on its own."""
    alone = Batcher(core.nodes, core.batcher.durability, core.settings.durability_timeout_ms, max_batch=1)
    m = Membership(core.db, core.redis, core.scripts, core.settings.membership_cache_seconds, alone)
    return dataclasses.replace(core, batcher=alone, membership=m)


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "unbatched"])
async def test_a_thousand_members_race_for_a_hundred_shares(core: Core, batched: bool) -> None:
    core = core if batched else unbatched(core)
    w = await make_world(core, members=1_000, admin_cents=100_000)
    p = await packets.send_packet(
        core, sender_id=w.admin, group_id=w.group, kind="lucky", total=20_000, count=100
    )
    results = await asyncio.gather(
        *(grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=u) for u in w.members),
        return_exceptions=True,
    )
    won = [r for r in results if isinstance(r, grabs.GrabResult)]
    refused = [r for r in results if isinstance(r, RedPacketError)]
    assert len(won) == 100 and all(r.outcome == "won" for r in won)
    assert len(refused) == 900 and {e.code for e in refused} == {errors.PACKET_EMPTY}
    assert sum(r.grab.amount for r in won) == 20_000
    assert len({r.grab.user_id for r in won}) == 100
    assert sorted(r.grab.seq for r in won) == list(range(1, 101))
    view = await grabs.open_packet(core, packet_id=p.packet_id, group_id=w.group, user_id=won[0].grab.user_id)
    assert view.remaining == 0 and len(view.grabs) == 100 and view.finished_ms is not None


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "unbatched"])
async def test_fifty_grabs_by_one_user_take_one_share(core: Core, batched: bool) -> None:
    core = core if batched else unbatched(core)
    w = await make_world(core, members=2, admin_cents=10_000)
    p = await packets.send_packet(
        core, sender_id=w.admin, group_id=w.group, kind="lucky", total=1_000, count=2
    )
    results = await asyncio.gather(
        *(grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=w.members[0]) for _ in range(50))
    )
    assert Counter(r.outcome for r in results) == {"won": 1, "already": 49}
    assert len({(r.grab.seq, r.grab.amount, r.grab.grabbed_ms) for r in results}) == 1
    assert await core.redis.llen(keys.packet_shares(group_id=w.group, packet_id=p.packet_id)) == 1
    other = await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=w.members[1])
    assert other.grab.amount + results[0].grab.amount == 1_000


async def _books(core: Core) -> tuple[list[tuple[object, ...]], ...]:
    return (
        await core.db.fetchall("SELECT user_id, balance FROM accounts ORDER BY user_id"),
        await core.db.fetchall("SELECT id, account_id, amount FROM journal ORDER BY id"),
        await core.db.fetchall("SELECT packet_id, user_id, seq FROM grab_records ORDER BY id"),
    )


async def test_refusals_have_stable_codes(core: Core) -> None:
    w = await make_world(core, members=3, admin_cents=10_000)
    outsider = await ledger.create_user(core.db, "outsider")
    p = await packets.send_packet(core, sender_id=w.admin, group_id=w.group, kind="equal", total=100, count=1)
    other_group = await groups.create_group(core.db, w.admin, "other")
    await groups.add_members(core.db, core.membership, other_group, [w.members[0]])

    books = await _books(core)
    shares_left = await core.redis.lrange(keys.packet_shares(group_id=w.group, packet_id=p.packet_id), 0, -1)
    assert await _grab_code(core, p.packet_id, w.group, outsider) == errors.NOT_MEMBER
    assert await _grab_code(core, 424242, w.group, w.members[0]) == errors.PACKET_NOT_FOUND
    # A packet asked for through another group the user is in: not found, nothing leaks.
    assert await _grab_code(core, p.packet_id, other_group, w.members[0]) == errors.PACKET_NOT_FOUND
    # Refused grabs took no share and moved no money.
    assert (
        await core.redis.lrange(keys.packet_shares(group_id=w.group, packet_id=p.packet_id), 0, -1)
        == shares_left
    )
    assert await _books(core) == books
    assert await _grab_code(core, p.packet_id, w.group, w.members[0]) == "won"
    assert await _grab_code(core, p.packet_id, w.group, w.members[1]) == errors.PACKET_EMPTY

    expired_core = dataclasses.replace(core, settings=core.settings.replace(packet_ttl_seconds=0))
    q = await packets.send_packet(
        expired_core, sender_id=w.admin, group_id=w.group, kind="lucky", total=100, count=2
    )
    books = await _books(core)
    assert await _grab_code(core, q.packet_id, w.group, w.members[0]) == errors.PACKET_EXPIRED
    assert await core.redis.llen(keys.packet_shares(group_id=w.group, packet_id=q.packet_id)) == 2
    assert await _books(core) == books

    ex = await packets.send_packet(
        core,
        sender_id=w.admin,
        group_id=w.group,
        kind="exclusive",
        total=300,
        count=None,
        greeting="for you",
        target_user_id=w.members[2],
    )
    assert await _grab_code(core, ex.packet_id, w.group, w.members[1]) == errors.NOT_TARGET
    assert await _grab_code(core, ex.packet_id, w.group, w.members[2]) == "won"


async def test_the_gate_charges_one_attempt_once_and_refuses_before_any_share_is_taken(core: Core) -> None:
    """The hub's block and rate limit run inside the grab script: a cold member cache or a packet
    recovered from the database (each a second call) never takes two tokens for one attempt."""
    one_token = dataclasses.replace(
        core, settings=core.settings.replace(grabs_per_second=0.001, grabs_burst=1)
    )
    w = await make_world(core, members=4, admin_cents=10_000)
    p = await packets.send_packet(core, sender_id=w.admin, group_id=w.group, kind="lucky", total=400, count=4)
    a, b, c, d = w.members
    # Cold member cache: the first call stops before the gate, the second takes the one token.
    await core.redis.delete(keys.group_members(w.group))
    assert await _grab_code(one_token, p.packet_id, w.group, a, gate=True) == "won"
    assert await _grab_code(one_token, p.packet_id, w.group, a, gate=True) == errors.RATE_LIMITED
    # Packet keys lost: the call that finds it unknown took the token; the call after recovery takes none.
    await core.redis.delete(*keys.packet_keys(group_id=w.group, packet_id=p.packet_id))
    assert await _grab_code(one_token, p.packet_id, w.group, b, gate=True) == "won"
    # Blocked, and limited: refused before any share is taken, nothing queued for them.
    await block(core, c)
    assert await _grab_code(one_token, p.packet_id, w.group, c, gate=True) == errors.BLOCKED
    assert await _grab_code(one_token, p.packet_id, w.group, b, gate=True) == errors.RATE_LIMITED
    assert await core.redis.llen(keys.packet_shares(group_id=w.group, packet_id=p.packet_id)) == 2
    assert await core.redis.hkeys(keys.packet_grabs(group_id=w.group, packet_id=p.packet_id)) == [
        str(u).encode() for u in (a, b)
    ]
    assert len(await outbox(core, w.group)) == 2
    # No limit to speak of (a rate of a million a second, an interval under a millisecond): it passes.
    unlimited = dataclasses.replace(core, settings=core.settings.replace(grabs_per_second=1_000_000.0))
    assert await _grab_code(unlimited, p.packet_id, w.group, d, gate=True) == "won"
    assert await _grab_code(unlimited, p.packet_id, w.group, d, gate=True) == "already"
    # Without the gate (not the hub) neither applies.
    assert await _grab_code(one_token, p.packet_id, w.group, c) == "won"


async def test_removed_member_cannot_grab(core: Core) -> None:
    w = await make_world(core, members=2, admin_cents=10_000)
    p = await packets.send_packet(core, sender_id=w.admin, group_id=w.group, kind="lucky", total=100, count=2)
    assert await core.membership.is_member(group_id=w.group, user_id=w.members[0])  # warm the cache
    await groups.remove_member(core.db, core.membership, group_id=w.group, user_id=w.members[0])
    assert await _grab_code(core, p.packet_id, w.group, w.members[0]) == errors.NOT_MEMBER
    await groups.add_members(core.db, core.membership, w.group, [w.members[0]])
    assert await _grab_code(core, p.packet_id, w.group, w.members[0]) == "won"


async def test_grab_survives_script_flush(core: Core) -> None:
    w = await make_world(core, members=2, admin_cents=10_000)
    p = await packets.send_packet(core, sender_id=w.admin, group_id=w.group, kind="lucky", total=100, count=2)
    await core.redis.script_flush()
    assert (
        await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=w.members[0])
    ).outcome == "won"
    assert await core.redis.script_exists(core.scripts.sha("grab")) == [True]


async def test_open_is_a_read_with_grab_order_best_luck_and_duration(core: Core) -> None:
    w = await make_world(core, members=3, admin_cents=10_000)
    p = await packets.send_packet(
        core, sender_id=w.admin, group_id=w.group, kind="lucky", total=999, count=3, greeting="大吉"
    )
    before = await grabs.open_packet(core, packet_id=p.packet_id, group_id=w.group, user_id=w.members[0])
    assert (
        before.mine is None
        and before.remaining == 3
        and before.best_luck is None
        and before.duration_ms is None
    )
    results = [await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=u) for u in w.members]
    views = [
        await grabs.open_packet(core, packet_id=p.packet_id, group_id=w.group, user_id=w.members[1])
        for _ in range(3)
    ]
    assert views[0] == views[1] == views[2]
    v = views[0]
    assert v.mine == results[1].grab
    assert [g.user_id for g in v.grabs] == w.members  # grab order
    assert sum(g.amount for g in v.grabs) == 999 and v.remaining == 0 and v.greeting == "大吉"
    assert v.best_luck is not None and v.best_luck.amount == max(r.grab.amount for r in results)
    assert v.duration_ms is not None and v.duration_ms >= 0
    assert await core.redis.llen(keys.packet_shares(group_id=w.group, packet_id=p.packet_id)) == 0


async def test_open_refuses_non_members(core: Core) -> None:
    w = await make_world(core, members=1, admin_cents=10_000)
    outsider = await ledger.create_user(core.db, "outsider")
    p = await packets.send_packet(core, sender_id=w.admin, group_id=w.group, kind="lucky", total=100, count=1)
    with pytest.raises(RedPacketError) as e:
        await grabs.open_packet(core, packet_id=p.packet_id, group_id=w.group, user_id=outsider)
    assert e.value.code == errors.NOT_MEMBER


async def test_membership_cache_is_filled_from_the_database(core: Core) -> None:
    w = await make_world(core, members=0)
    late = await bulk_users(core.db, "late", 3)
    await groups.add_members(core.db, core.membership, w.group, late)
    assert await core.membership.is_member(group_id=w.group, user_id=late[1])
    cached = await core.redis.smembers(keys.group_members(w.group))
    assert cached == {keys.LOADED, *(str(u).encode() for u in [w.admin, *late])}


async def test_a_cache_reload_that_races_a_removal_writes_nothing(core: Core) -> None:
    w = await make_world(core, members=2)
    version_key = keys.group_members_version(w.group)
    before = await core.redis.get(version_key)
    # A reload read the members (both), then the removal commits and invalidates...
    await groups.remove_member(core.db, core.membership, group_id=w.group, user_id=w.members[0])
    # ...and the reload's late write is refused, so the removed member is never cached as present.
    fill = FillMembersCall(
        group_id=w.group, version=before or b"", ttl_seconds=60, members=frozenset([w.admin, *w.members])
    )
    assert await run_alone(core.scripts, fill) is False
    assert await core.redis.exists(keys.group_members(w.group)) == 0
    assert not await core.membership.is_member(group_id=w.group, user_id=w.members[0])
    assert await core.membership.is_member(group_id=w.group, user_id=w.members[1])
