"""``server.hub.protocol``, pure: formats and subprotocols, frames in and out, the request envelope and its
limits, id fields, replies, offsets."""

from __future__ import annotations

import json
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from server import errors
from server.errors import NotFound
from server.hub import protocol
from server.hub.protocol import ProtocolError
from server.ids import MAX_ID

MSGPACK = protocol.DIALECTS[protocol.SUBPROTOCOL_MSGPACK]
JSON = protocol.DIALECTS[protocol.SUBPROTOCOL_JSON]


def refused(message: Any, max_depth: int = 8) -> str:
    with pytest.raises(ProtocolError) as e:
        protocol.parse_request(message, max_depth)
    return e.value.code


def test_msgpack_unless_json_is_asked_for_and_only_our_subprotocol_is_accepted() -> None:
    def chosen(offered: list[str]) -> tuple[str, int, str | None]:
        d = protocol.choose_dialect(offered)
        return d.format, d.version, d.subprotocol

    assert chosen([]) == ("msgpack", 1, None)
    assert chosen(["chat", "bearer.abc"]) == ("msgpack", 1, None)
    assert chosen(["bearer.abc", "redpacket.v1.json"]) == ("json", 1, "redpacket.v1.json")
    both = ["redpacket.v1.json", "redpacket.v1.msgpack"]
    assert chosen(both) == ("json", 1, "redpacket.v1.json")  # the client's first choice
    assert chosen(both[::-1]) == ("msgpack", 1, "redpacket.v1.msgpack")
    assert chosen(["redpacket.v3.json", "redpacket.v2.json"]) == ("json", 2, "redpacket.v2.json")
    assert chosen(["redpacket.v2.msgpack", "redpacket.v1.json"]) == ("msgpack", 2, "redpacket.v2.msgpack")


def test_a_token_offered_as_a_subprotocol_is_read_and_an_empty_one_is_none() -> None:
    assert protocol.offered_token(["redpacket.v1.json", "bearer.eyJ.x.y"]) == "eyJ.x.y"
    assert protocol.offered_token(["bearer."]) is None
    assert protocol.offered_token(["redpacket.v1.json", "Bearer.x"]) is None


@pytest.mark.parametrize(
    ("origin", "host", "allowed", "ok"),
    [
        ("https://evil.example", "hub:8000", (), True),  # no list: anyone (not browsers' business here)
        (None, "hub:8000", ("https://chat.example",), True),  # no Origin: not a browser
        ("https://chat.example", "hub:8000", ("https://chat.example",), True),
        ("HTTPS://Chat.Example/", "hub:8000", ("https://chat.example",), True),
        ("https://evil.example", "hub:8000", ("https://chat.example",), False),
        ("http://hub:8000", "hub:8000", ("self",), True),
        ("https://HUB:8000", "hub:8000", ("self",), True),
        ("http://hub:8001", "hub:8000", ("self",), False),
        ("http://hub:8000", None, ("self",), False),
    ],
)
def test_which_pages_may_open_a_socket(
    origin: str | None, host: str | None, allowed: tuple[str, ...], ok: bool
) -> None:
    assert protocol.origin_allowed(origin, host, allowed) is ok


def test_frames_decode_by_their_kind_and_a_bad_one_is_bad_frame() -> None:
    message = {"id": 1, "type": "ping", "text": "红包"}
    assert protocol.decode(protocol.encode(MSGPACK, message)) == message
    assert protocol.decode(protocol.encode(JSON, message)) == message
    assert protocol.encode(JSON, message) == '{"id":1,"type":"ping","text":"红包"}'  # compact, not escaped
    for bad in (b"\xc1", "{", "", b"", msgpack.packb({1: "int key"})):
        with pytest.raises(ProtocolError) as e:
            protocol.decode(bad)
        assert e.value.code == errors.BAD_FRAME, bad


@given(st.integers(-(2**63), 2**64 - 1) | st.text(max_size=64))
def test_every_valid_id_is_answered_with_itself(rid: int | str) -> None:
    assert protocol.request_id_of({"id": rid}) == rid
    assert protocol.parse_request({"id": rid, "type": "ping"}, 8).id == rid


@pytest.mark.parametrize(
    "rid", [-(2**63) - 1, 2**64, True, False, None, 1.0, "x" * 65, "\ud800", [1], {"a": 1}]
)
def test_an_id_out_of_range_or_of_another_kind_is_answered_null(rid: object) -> None:
    assert protocol.request_id_of({"id": rid}) is None
    assert refused({"id": rid, "type": "ping"}) == errors.BAD_REQUEST


def test_the_envelope_is_a_map_with_a_known_type() -> None:
    assert protocol.request_id_of([1]) is None
    assert refused([{"id": 1, "type": "ping"}]) == errors.BAD_REQUEST
    assert refused({"type": "ping"}) == errors.BAD_REQUEST  # no id
    assert refused({"id": 1}) == errors.UNKNOWN_TYPE
    assert refused({"id": 1, "type": "launch"}) == errors.UNKNOWN_TYPE
    for kind in protocol.REQUEST_TYPES:
        req = protocol.parse_request({"id": "a", "type": kind, "group": 3}, 8)
        assert (req.id, req.type, req.body["group"]) == ("a", kind, 3)


def test_a_message_deeper_than_the_limit_or_holding_a_lone_surrogate_is_a_bad_request() -> None:
    def nested(depth: int) -> dict[str, Any]:
        message: dict[str, Any] = {"id": 1, "type": "chat"}
        inner: Any = "leaf"
        for _ in range(depth - 1):
            inner = [inner]
        message["x"] = inner
        return message

    protocol.parse_request(nested(8), 8)  # the envelope is depth 1: seven lists inside it
    assert refused(nested(9)) == errors.BAD_REQUEST
    assert refused(nested(10_000)) == errors.BAD_REQUEST  # refused without recursing
    assert refused({"id": 1, "type": "chat", "text": "a\udc00b"}) == errors.BAD_REQUEST
    assert refused({"id": 1, "type": "chat", "\ud83d": "key"}) == errors.BAD_REQUEST


def test_integer_fields_are_integers_and_ids_are_in_the_id_range() -> None:
    assert protocol.field_int({"n": -3}, "n") == -3
    for bad in (True, "3", 3.0, None):
        with pytest.raises(ProtocolError) as e:
            protocol.field_int({"n": bad}, "n")
        assert e.value.code == errors.BAD_REQUEST
    assert protocol.field_id({"packet": 1}, "packet", errors.PACKET_NOT_FOUND) == 1
    assert protocol.field_id({"packet": MAX_ID}, "packet", errors.PACKET_NOT_FOUND) == MAX_ID
    for no_such in (0, -1, MAX_ID + 1, 2**64):
        with pytest.raises(NotFound) as missing:
            protocol.field_id({"packet": no_such}, "packet", errors.PACKET_NOT_FOUND)
        assert missing.value.code == errors.PACKET_NOT_FOUND  # not a database error on a BIGINT
    with pytest.raises(ProtocolError):
        protocol.field_id({}, "packet", errors.PACKET_NOT_FOUND)


def test_replies_and_events_have_one_shape() -> None:
    assert protocol.reply_ok(7, {"a": 1}) == {"type": "reply", "id": 7, "ok": True, "data": {"a": 1}}
    assert protocol.reply_error(None, "bad_frame", "no") == {
        "type": "reply",
        "id": None,
        "ok": False,
        "error": {"code": "bad_frame", "message": "no"},
    }
    # Details a client words its message with sit beside the code, which they cannot replace.
    detailed = protocol.reply_error("r", "count_too_large", "at most 100", {"limit": 100, "code": "x"})
    assert detailed["error"] == {"limit": 100, "code": "count_too_large", "message": "at most 100"}
    assert protocol.event(3, "1-0", "chat", {"t": "hi"}) == {
        "type": "event",
        "group": 3,
        "offset": "1-0",
        "event": "chat",
        "data": {"t": "hi"},
    }
    assert json.loads(str(protocol.encode(JSON, detailed)))["error"]["limit"] == 100


@pytest.mark.parametrize(
    ("given_offset", "offset"),
    [
        (None, None),
        ("0", "0-0"),
        ("1700000000000-3", "1700000000000-3"),
        ("007-01", "7-1"),
        (str(2**64 - 1) + "-" + str(2**64 - 1), f"{2**64 - 1}-{2**64 - 1}"),
    ],
)
def test_an_offset_is_null_or_a_stream_id(given_offset: object, offset: str | None) -> None:
    assert protocol.parse_offset(given_offset) == offset


@pytest.mark.parametrize(
    "bad", ["", "-", "1-", "-1", "1-2-3", "a-1", " 1-0", "１-0", str(2**64), 17, [1], "1" * 21]
)
def test_anything_else_as_an_offset_is_a_bad_request(bad: object) -> None:
    with pytest.raises(ProtocolError) as e:
        protocol.parse_offset(bad)
    assert e.value.code == errors.BAD_REQUEST


def test_big_room_announcements_list_the_latest_grabs_and_what_is_left() -> None:
    items = [
        {"packet_id": 1 + i % 2, "user": i, "amount": 5, "seq": i, "ms": i, "remaining": 20 - i}
        for i in range(12)
    ]
    assert protocol.grabs_announcement(items, None) == {"grabs": items}
    assert protocol.grabs_announcement(items[:3], 10) == {"grabs": items[:3]}
    big = protocol.grabs_announcement(items, 10)
    assert big["grabs"] == items[2:] and big["more"] == 2
    assert big["remaining"] == {"1": 10, "2": 9}
    assert protocol.announce_interval(0.1, 500, 500, 20_000) == 0.1
    assert protocol.announce_interval(0.1, 1_000, 500, 20_000) == 0.1
    assert protocol.announce_interval(0.1, 10_000, 500, 20_000) == 0.5


def test_the_packet_view_is_sent_with_every_field_of_the_dataclass() -> None:
    from dataclasses import asdict

    from server.money.grabs import Grab, PacketView, view_dict

    grabs = [Grab(8, 2, 301, 1_796_000_000_450), Grab(7, 1, 587, 1_796_000_001_200)]
    v = PacketView(
        9,
        1,
        7,
        "lucky",
        888,
        2,
        "恭喜发财",
        1_796_000_000_000,
        1_796_086_400_000,
        0,
        grabs,
        grabs[0],
        1_796_000_001_200,
        grabs[1],
    )
    assert view_dict(v) == {**asdict(v), "duration_ms": 1200}
    open_one = PacketView(9, 1, 7, "equal", 10, 2, "", 1, 2, 2, [], None, None, None)
    assert view_dict(open_one) == {**asdict(open_one), "duration_ms": None}
