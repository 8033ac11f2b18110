"""Ids as text (``server.ids``): which fields are ids is one decision, held to both API documents, and a
version-2 connection gets every id exact as a string, both ways."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import msgpack
import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from server import errors
from server.hub import protocol
from server.hub.protocol import ProtocolError
from server.ids import ID_FIELDS, ID_LIST_FIELDS, MAX_ID, ids_as_text, ids_from_text

ROOT = Path(__file__).resolve().parents[2]
BIG = 2**63 - 25  # above 2^53: a JavaScript number cannot hold it
V2_JSON = protocol.DIALECTS[protocol.SUBPROTOCOL_JSON_V2]
V2_MSGPACK = protocol.DIALECTS[protocol.SUBPROTOCOL_MSGPACK_V2]


ID_REF = "#/components/schemas/Id"
CURSOR_REF = "#/components/schemas/Cursor"  # (an id, or 0 before the first page)


def _is_id(schema: Any) -> bool:
    """An id's schema in our documents: ``Id`` (nullable or not), or a list of them."""
    if not isinstance(schema, dict):
        return False
    if schema.get("$ref") in (ID_REF, CURSOR_REF) or any(
        _is_id(s) for s in schema.get("oneOf", []) + schema.get("allOf", [])
    ):
        return True
    return schema.get("type") == "array" and _is_id(schema.get("items"))


def _fields(node: Any, found: dict[str, set[str]]) -> None:
    """Every property of every schema in a document, each name with the kinds of value it holds: an
    ``Id``, a 64-bit integer written out, or something else."""
    if isinstance(node, dict):
        for name, schema in (node.get("properties") or {}).items():
            if isinstance(schema, dict):
                items = schema.get("items") or {}
                ranged = MAX_ID in (schema.get("maximum"), items.get("maximum"))
                found[name].add("id" if _is_id(schema) else "id range" if ranged else "other")
        for value in node.values():
            _fields(value, found)
    elif isinstance(node, list):
        for value in node:
            _fields(value, found)


DOCS = {
    "openapi": json.loads((ROOT / "docs" / "openapi.json").read_text()),
    "asyncapi": yaml.safe_load((ROOT / "docs" / "asyncapi.yaml").read_text()),
}


def test_the_id_fields_are_exactly_the_documents_ids() -> None:
    ids: set[str] = set()
    for name, doc in DOCS.items():
        found: dict[str, set[str]] = defaultdict(set)
        _fields(doc, found)
        # (not ids, though 64-bit: the journal's row numbers, a group's member-list version)
        assert {n for n, kinds in found.items() if "id range" in kinds} <= {"id", "version"}, name
        documented = {n for n, kinds in found.items() if "id" in kinds}
        assert documented <= ID_FIELDS | ID_LIST_FIELDS, documented - (ID_FIELDS | ID_LIST_FIELDS)
        for field in ID_FIELDS & found.keys():  # an id wherever it appears
            assert found[field] == {"id"}, (name, field)
        ids |= documented
    assert ids == ID_FIELDS | ID_LIST_FIELDS  # and each name of ours is an id somewhere


def test_every_id_becomes_its_decimal_and_nothing_else_changes() -> None:
    message = {
        "type": "event",
        "group": BIG,
        "offset": "1-0",
        "id": 7,
        "data": {
            "packet_id": BIG - 1,
            "sender": 3,
            "target": None,
            "total": 888,
            "grabs": [{"user_id": BIG - 2, "seq": 1, "amount": 53, "grabbed_ms": 1796000000450}],
            "members": 3,
            "online": True,
            "added": [BIG, 5],
        },
    }
    assert ids_as_text(message) == {
        "type": "event",
        "group": str(BIG),
        "offset": "1-0",
        "id": 7,
        "data": {
            "packet_id": str(BIG - 1),
            "sender": "3",
            "target": None,
            "total": 888,
            "grabs": [{"user_id": str(BIG - 2), "seq": 1, "amount": 53, "grabbed_ms": 1796000000450}],
            "members": 3,
            "online": True,
            "added": [str(BIG), "5"],
        },
    }
    assert message["group"] == BIG  # the message itself is left as it was (others may encode it too)


@given(st.integers(0, 2**64 - 1))
def test_an_id_sent_as_text_is_the_same_number(n: int) -> None:
    assert ids_from_text({"group": str(n), "user_ids": [str(n), n]}) == {"group": n, "user_ids": [n, n]}


@pytest.mark.parametrize("bad", ["07", " 7", "7 ", "7.0", "-7", "+7", "", "seven", "１"])
def test_an_id_string_that_is_not_plain_digits_is_bad_request(bad: str) -> None:
    with pytest.raises(ValueError, match="group must be an id"):
        ids_from_text({"group": bad})
    with pytest.raises(ProtocolError) as e:
        protocol.parse_request({"id": 1, "type": "grab", "group": bad, "packet": "1"}, 8, text_ids=True)
    assert e.value.code == errors.BAD_REQUEST


def test_a_version_2_connection_reads_and_writes_ids_as_text_in_both_formats() -> None:
    req = protocol.parse_request(
        {"id": 5, "type": "grab", "group": str(BIG), "packet": BIG - 1}, 8, text_ids=True
    )
    assert req.body["group"] == BIG and req.body["packet"] == BIG - 1 and req.id == 5
    # Version 1 is unchanged: a string id reaches the handler as a string (which refuses it).
    assert protocol.parse_request({"id": 5, "type": "grab", "group": "3"}, 8).body["group"] == "3"
    reply = protocol.reply_ok(5, {"packet": BIG - 1, "user_id": BIG, "amount": 53, "seq": 1})
    as_json = json.loads(protocol.encode(V2_JSON, reply))
    as_msgpack = msgpack.unpackb(protocol.encode(V2_MSGPACK, reply))
    for decoded in (as_json, as_msgpack):
        assert decoded["data"] == {"packet": str(BIG - 1), "user_id": str(BIG), "amount": 53, "seq": 1}
        assert decoded["id"] == 5
