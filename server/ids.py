"""Ids of users, groups and packets: positive signed 64-bit integers (their database columns are BIGINT),
in every layer alike.

Each kind of id is its own type to the type checker (``NewType``: at run time a plain ``int``, at no
cost), so passing a packet id where a group id is wanted fails ``mypy``. A value becomes one where it
enters the system — a field of a request (``PacketId(field_id(...))``), a token's subject, a database row,
a Redis reply — and keeps its type from there. Functions that take two ids also take them by keyword
(``group_id=``, ``packet_id=``, ``user_id=`` everywhere), so a swap cannot hide behind two ids that happen
to share a type.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, NewType

MAX_ID = 2**63 - 1

UserId = NewType("UserId", int)
GroupId = NewType("GroupId", int)
PacketId = NewType("PacketId", int)
# A share's place in its packet's split, 1 … count: the order the shares were drawn and are handed out.
ShareSeq = NewType("ShareSeq", int)


# -- ids as text --------------------------------------------------------------------------------------------
#
# A JavaScript program reads a JSON number into a double, exact only up to 2^53 - 1: a chat backend's 64-bit
# snowflake ids come out changed. So a client may ask for every user, group and packet id as its decimal
# string (the websocket's ``redpacket.v2.*`` subprotocols; the HTTP API's ``Redpacket-Ids: string``
# header), as Discord's API and Twitter's ``id_str`` do. Which fields are ids is decided here, once, by
# name — the same name is never an id in one message and something else in another, which
# ``tests/unit/test_ids.py`` holds to the documents (docs/asyncapi.yaml, docs/openapi.json):

# A field whose value is an id (or a list of ids) wherever it appears. (``by``: who changed a group's
# members, 0 for the chat backend.)
ID_FIELDS = frozenset(
    {"by", "group", "group_id", "packet", "packet_id", "sender", "sender_id", "target", "user", "user_id"}
    | {"next"}  # a list's cursor (``server.hub.httpkit.page``): a packet's id on some lists
)
# A field that holds a list of ids, and elsewhere a count or a flag (``members: 3``, ``online: true``):
# only its lists are ids.
ID_LIST_FIELDS = frozenset({"members", "admins", "added", "removed", "roles_changed", "online", "user_ids"})
# Not ids, so numbers in every format: request ids (echoed as the client sent them), event and journal
# numbers (``id``, ``after``), versions, amounts, sequence numbers and times.

# (Up to 40 digits: a number no id can be is then answered not found, as an integer would be.)
_DIGITS = re.compile(r"0|[1-9][0-9]{0,39}", re.ASCII)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _map_ids(value: Any, one: Callable[[str, object], object]) -> Any:
    """``value`` (a message: maps, lists, scalars) copied, with ``one(field, value)`` made of every scalar
    under an id's name (each item of a list of them; maps and lists inside are walked as any)."""
    if isinstance(value, dict):
        out: dict[Any, Any] = {}
        for k, v in value.items():
            if isinstance(v, list) and (k in ID_FIELDS or k in ID_LIST_FIELDS):
                out[k] = [_map_ids(i, one) if isinstance(i, dict | list) else one(k, i) for i in v]
            elif k in ID_FIELDS and not isinstance(v, dict):
                out[k] = one(k, v)
            else:
                out[k] = _map_ids(v, one)
        return out
    if isinstance(value, list):
        return [_map_ids(v, one) for v in value]
    return value


def _id_as_text(name: str, value: object) -> object:
    return str(value) if _is_int(value) else value


def ids_as_text(value: Any) -> Any:
    """``value`` (a message) with every id as its decimal string; other values as they were. A copy: the
    message may be encoded for other connections too."""
    return _map_ids(value, _id_as_text)


def _id_from_text(name: str, value: object) -> object:
    if isinstance(value, str):
        if _DIGITS.fullmatch(value) is None:
            raise ValueError(f"{name} must be an id: an integer, or its decimal digits as a string")
        return int(value)
    return value


def ids_from_text(value: Any) -> Any:
    """A request as a client that sends ids as decimal strings wrote it, with those ids as integers (an
    integer id is taken as it is). A string under an id's name that is not the decimal digits of a whole
    number (``"07"``, ``" 7"``, ``"7.0"``) raises ``ValueError`` saying so: the caller answers
    ``bad_request``. The ids are then checked as every id is (``server.hub.protocol.field_id``)."""
    return _map_ids(value, _id_from_text)
