"""The typed calls of the Lua scripts (server/store/scriptcalls.py), without Redis: each builds its KEYS
in the slot of its group and its ARGV in the order its script names them, and parses a reply of the
script's shape into a typed result, refusing any other shape."""

from __future__ import annotations

import pytest

from server.ids import GroupId, PacketId, ShareSeq, UserId
from server.store import keys
from server.store.records import CreditEntry, GrabRecord, ShareEntry
from server.store.scriptcalls import (
    AckCreditsCall,
    ClosePacketCall,
    FillMembersCall,
    GrabCall,
    GrabRate,
    LoadPacketCall,
    Once,
    PresenceCall,
    PublishEventCall,
    ReadEventsCall,
    run,
)

G, P, U = GroupId(70), PacketId(9), UserId(5)


def slot_tags(names: list[str]) -> set[str]:
    return {name[name.index("{") : name.index("}") + 1] for name in names}


def grab(**changes: object) -> GrabCall:
    fields: dict[str, object] = {
        "user_id": U, "group_id": G, "packet_id": P, "check_members": True, "rate": GrabRate(5, 10),
        "rewrite_repeat": False,
    }  # fmt: skip
    fields.update(changes)
    return GrabCall(**fields)  # type: ignore[arg-type]


def test_the_grab_call_names_its_inputs_in_the_scripts_order() -> None:
    call = grab()
    assert call.keys() == [
        *keys.packet_keys(group_id=G, packet_id=P)[:3],
        keys.group_members(G),
        keys.gate_for(G),
        keys.grab_bucket(group_id=G, user_id=U),
        keys.outbox_for(G),
    ]
    assert len(slot_tags(call.keys())) == 1  # one slot: it runs on a cluster
    assert call.argv() == [U, G, P, "1", 5, 10, keys.LOADED, "0"]
    assert grab(rate=None, check_members=False, rewrite_repeat=True).argv()[3:] == [
        "0",
        "",
        "",
        keys.LOADED,
        "1",
    ]


def test_the_grab_reply_is_parsed_by_status() -> None:
    call = grab()
    won = call.parse([b"won", b"3:250:1700", 7])
    assert (won.status, won.record, won.remaining) == ("won", GrabRecord(ShareSeq(3), 250, 1700), 7)
    assert call.parse([b"limited", 120]).wait_ms == 120
    assert call.parse([b"empty"]).status == "empty"
    wait = call.durability()
    assert callable(wait) and wait([b"already", b"3:250:1700", 0]) and not wait([b"empty"])


@pytest.mark.parametrize(
    "reply", [[b"won", b"3:250:1700"], [b"lost"], b"won", [], [b"limited"], [b"won", 5, 1]]
)
def test_a_grab_reply_of_another_shape_is_refused(reply: object) -> None:
    with pytest.raises(ValueError):
        grab().parse(reply)


def test_loading_a_packet_sends_its_meta_shares_and_grabs_counted() -> None:
    call = LoadPacketCall(
        group_id=G,
        packet_id=P,
        expire_at_ms=99,
        meta={"group": G, "kind": "lucky"},
        shares=[ShareEntry(ShareSeq(1), 300), ShareEntry(ShareSeq(2), 200)],
        grabs={U: GrabRecord(ShareSeq(2), 200, 1700)},
        stamp="run/master:repl",
    )
    assert call.keys() == [*keys.packet_keys(group_id=G, packet_id=P), keys.outbox_for(G)]
    assert call.argv() == [
        *(99, P, keys.PACKET_STAMP, "run/master:repl"),
        *(2, "group", G, "kind", "lucky"),
        *(2, "1:300", "2:200"),
        *(1, U, "2:200:1700"),
    ]
    loaded = call.parse([1, 1, [b"6:1:300:1600"]])
    assert (loaded.shares_left, loaded.grabs_known, loaded.dropped[0].user_id) == (1, 1, 6)


def test_filling_members_and_publishing_name_their_inputs() -> None:
    fill = FillMembersCall(group_id=G, version=b"4", ttl_seconds=60, members=frozenset({U}))
    assert fill.keys() == [keys.group_members(G), keys.group_members_version(G)]
    assert fill.argv() == [b"4", 60, keys.LOADED, U]
    assert fill.parse(1) is True and fill.parse(0) is False
    once = PublishEventCall(
        group_id=G, payload=b"p", max_length=100, ttl_seconds=60, once=Once("packet:9", 30)
    )
    assert once.keys() == [keys.group_events(G), keys.group_once(G, "packet:9")]
    assert once.argv() == [keys.group_channel(G), 100, b"p", 60, 30]
    plain = PublishEventCall(group_id=G, payload=b"p", max_length=100, ttl_seconds=60, once=None)
    assert plain.keys() == [keys.group_events(G)] and plain.argv() == [keys.group_channel(G), 100, b"p", 60]
    assert plain.parse(b"5-0") == "5-0"


def test_the_close_reply_is_the_grabs_by_user() -> None:
    call = ClosePacketCall(group_id=G, packet_id=P, close=True, expire_at_ms=99)
    assert call.argv() == ["1", 99] and call.durability() is True
    closed = call.parse([1, [b"5", b"3:250:1700"], [b"6:4:100:1800"]])
    assert closed.present and closed.grabs == {U: GrabRecord(ShareSeq(3), 250, 1700)}
    assert closed.dropped[0].user_id == 6
    with pytest.raises(ValueError):
        call.parse([1, [b"5", b"3:250:1700"]])


def test_acknowledging_names_each_paid_packet_once_in_its_shard() -> None:
    paid = CreditEntry(P, U, ShareSeq(3), 250, 1700, G)
    call = AckCreditsCall(keys.shard(G), [b"1-0", b"2-0"], {(G, P): [paid]})
    assert call.keys() == [keys.credit_outbox(keys.shard(G)), *keys.packet_keys(group_id=G, packet_id=P)[:3]]
    assert call.argv() == [
        keys.CREDIT_GROUP,
        2,
        b"1-0",
        b"2-0",
        1,
        U,
        ShareEntry(ShareSeq(3), 250).encode(),
        1700,
    ]
    assert len(slot_tags(call.keys())) == 1


def test_presence_answers_who_came_or_went_and_nothing_else() -> None:
    call = PresenceCall(group_id=G, hub_id="h1", action="join", lapse_ms=5, users=[UserId(1), UserId(2)])
    assert call.parse([0, 1]) == [UserId(2)]
    with pytest.raises(ValueError):
        call.parse([1])  # one answer per user, or the reply is not this script's


def test_reading_events_parses_the_stream_at_one_moment() -> None:
    call = ReadEventsCall(group_id=G, after="0-0", limit=10)
    assert call.parse([0]) is None
    stream = call.parse([1, 2, 5, b"3-0", b"4-0", [[b"4-0", [b"e", b"payload"]]]])
    assert stream is not None and (stream.length, stream.added, stream.first, stream.last) == (
        2,
        5,
        "3-0",
        "4-0",
    )
    assert stream.rows == [("4-0", b"payload")]


def test_only_a_grab_and_a_refunds_close_wait_for_durability() -> None:
    """A call whose durability is anything but False makes its whole pipeline read the server's data id
    and, with durable grabs, wait for WAITAOF/WAIT (server.store.batch): a publish or a presence update
    must not."""
    grab_call = grab()
    assert grab_call.durability() is not False
    assert ClosePacketCall(group_id=G, packet_id=P, close=True, expire_at_ms=1).durability() is True
    others = [
        LoadPacketCall(group_id=G, packet_id=P, expire_at_ms=1, meta={}, shares=[], grabs={}),
        AckCreditsCall(0, [], {}),
        FillMembersCall(group_id=G, version=b"", ttl_seconds=1, members=frozenset()),
        PublishEventCall(group_id=G, payload=b"", max_length=1, ttl_seconds=1, once=None),
        ReadEventsCall(group_id=G, after="0-0", limit=1),
        PresenceCall(group_id=G, hub_id="h", action="join", lapse_ms=1, users=[]),
    ]
    assert [c.durability() for c in others] == [False] * len(others)


async def test_run_hands_the_batcher_each_calls_own_durability() -> None:
    """run() passes the call's durability as it is: a publish goes out as not durable (once a bound method
    went instead, truthy for every call, and every pipeline read the data id and waited for WAITAOF).
    Only a grab is guarded (refused on an evicting master): a publish is not."""
    sent: list[object] = []

    class Batcher:
        async def script(
            self,
            script: object,
            keys_: list[str],
            args: list[object],
            durable: object = False,
            guarded: bool = False,
        ) -> object:
            sent.append((durable, guarded))
            return b"7-0"

    class Scripts:
        def get(self, name: str) -> object:
            return name

    publish = PublishEventCall(group_id=G, payload=b"p", max_length=1, ttl_seconds=1, once=None)
    assert await run(Batcher(), Scripts(), publish) == "7-0"  # type: ignore[arg-type]
    assert sent == [(False, False)]
    assert GrabCall.GUARDED and not PublishEventCall.GUARDED
