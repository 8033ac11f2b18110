"""``server.store.keys``, pure: every key of a group — its packets' included — in one hash slot, the shards
spread over distinct slots, channel names read back, and one deployment's names apart from another's."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st
from redis.crc import key_slot

from server.ids import MAX_ID
from server.store import keys

ids = st.integers(1, MAX_ID)


def slot(key: str) -> int:
    return key_slot(key.encode())


def group_keys(group: int, packet_id: int, user: int) -> list[str]:
    """Every key a script of this group may touch: the group's, a packet's, a member's, its shard's."""
    return [
        *keys.packet_keys(group_id=group, packet_id=packet_id),
        keys.group_members(group),
        keys.group_members_version(group),
        keys.group_events(group),
        keys.group_channel(group),
        keys.group_once(group, f"packet:{packet_id}"),
        keys.presence_online(group),
        keys.presence_hubs(group_id=group, user_id=user),
        keys.grab_bucket(group_id=group, user_id=user),
        keys.gate_for(group),
        keys.outbox_for(group),
    ]


@pytest.fixture
def namespaced() -> Iterator[str]:
    """This process names its keys ``unit-a`` for the test (as a Core does while it is open)."""
    keys.claim("unit-a")
    try:
        yield "unit-a"
    finally:
        keys.release()


@given(ids, ids, ids)
def test_every_key_of_a_group_and_its_packets_is_in_one_slot(group: int, packet_id: int, user: int) -> None:
    found = group_keys(group, packet_id, user)
    assert len(set(found)) == len(found)  # and no two are the same key
    assert {slot(k) for k in found} == {slot(f"{{s{group % keys.SHARDS}}}")}
    assert keys.shard(group) == group % keys.SHARDS


def test_a_packet_s_keys_come_in_the_order_the_scripts_take_them_and_name_only_it() -> None:
    meta, shares, grabs, dropped = keys.packet_keys(group_id=70, packet_id=9)
    assert (meta, shares, grabs, dropped) == (
        keys.packet_meta(group_id=70, packet_id=9),
        keys.packet_shares(group_id=70, packet_id=9),
        keys.packet_grabs(group_id=70, packet_id=9),
        keys.packet_dropped(group_id=70, packet_id=9),
    )
    others = {
        *keys.packet_keys(group_id=70, packet_id=90),
        keys.presence_hubs(group_id=70, user_id=9),
        keys.grab_bucket(group_id=70, user_id=9),
    }
    assert not others & {meta, shares, grabs, dropped}
    # A packet id is unique across groups: its group only says which shard it is in.
    assert keys.packet_keys(group_id=70 + keys.SHARDS, packet_id=9) == [meta, shares, grabs, dropped]
    assert keys.presence_hubs(group_id=70, user_id=9) != keys.presence_hubs(group_id=9, user_id=70)
    assert keys.grab_bucket(group_id=70, user_id=9) != keys.grab_bucket(group_id=9, user_id=70)


def test_the_shards_spread_over_distinct_slots_and_control_keys_share_theirs() -> None:
    assert len({slot(keys.shard_gate(n)) for n in range(keys.SHARDS)}) == keys.SHARDS
    assert len({slot(keys.credit_outbox(n)) for n in range(keys.SHARDS)}) == keys.SHARDS
    assert keys.outbox_for(3) == keys.outbox_for(3 + keys.SHARDS) == keys.credit_outbox(3)
    control = [
        keys.membership_channel(),
        keys.blocks(),
        keys.block_reasons(),
        keys.reconciled(),
        keys.throttles(),
        keys.forgiven(),
    ]
    assert len(set(control)) == len(control) and len({slot(k) for k in control}) == 1
    assert "{" not in keys.grab_attempts()  # a stream of its own, on whichever slot its name hashes to


@given(ids)
def test_a_group_channel_is_read_back_as_its_group(group: int) -> None:
    assert keys.channel_group(keys.group_channel(group)) == group
    assert keys.channel_group(keys.group_channel(group).encode()) == group


def test_any_other_channel_is_no_group_s() -> None:
    for other in (
        keys.membership_channel(),
        keys.group_events(5),
        "rp:{s5}:g:ch",
        "rp:{s5}:gx5:ch",
        "rp:other:{s5}:g5:ch",  # another deployment's
        "{s5}:g5:ch",
        "",
    ):
        assert keys.channel_group(other) is None, other


def test_a_deployment_s_names_carry_its_namespace_and_another_s_are_not_read(namespaced: str) -> None:
    members = keys.group_members(5)
    assert members.startswith(f"rp:{namespaced}:{{s5}}:")
    assert keys.grab_attempts() == f"rp:{namespaced}:attempts"
    assert keys.channel_group(keys.group_channel(5)) == 5
    assert keys.channel_group("rp:{s5}:g5:ch") is None  # the unnamed deployment's channel
    assert slot(members) == slot(keys.packet_meta(group_id=5, packet_id=1))
    assert keys.namespace() == namespaced


def test_a_process_serves_one_namespace_at_a_time(namespaced: str) -> None:
    keys.claim(namespaced)  # a second Core of the same deployment
    keys.release()
    with pytest.raises(RuntimeError):
        keys.claim("unit-b")
    assert keys.namespace() == namespaced


@pytest.mark.parametrize("bad", ["Upper", "-lead", "a" * 33, "under_score", "sp ace", "dot.ted", "é"])
def test_a_namespace_is_a_short_lowercase_name(bad: str) -> None:
    with pytest.raises(ValueError):
        keys.claim(bad)
    assert keys.NAMESPACE.fullmatch("a" * 32) and keys.NAMESPACE.fullmatch("0-deploy")
