"""``server.errors``: one tree, every error carrying a stable code. (That the codes are the ones
docs/protocol.md lists: ``test_error_table.py``.)"""

from __future__ import annotations

import re

import pytest

from server import errors
from server.errors import (
    Conflict,
    Forbidden,
    InvalidRequest,
    NotFound,
    RedPacketError,
    TooMany,
    Unavailable,
)


@pytest.mark.parametrize("kind", [InvalidRequest, Forbidden, NotFound, Conflict, TooMany, Unavailable])
def test_every_error_is_a_red_packet_error_that_carries_its_code(kind: type[RedPacketError]) -> None:
    e = kind(errors.PACKET_EMPTY, "every share has been grabbed", limit=3)
    assert isinstance(e, RedPacketError) and isinstance(e, Exception)
    assert (e.code, e.message, e.details) == ("packet_empty", "every share has been grabbed", {"limit": 3})
    assert str(e) == "every share has been grabbed"
    assert repr(e) == f"{kind.__name__}('packet_empty', 'every share has been grabbed')"
    bare = kind(errors.BLOCKED)
    assert (bare.message, str(bare), bare.details) == ("blocked", "blocked", {})  # the code says it


def test_codes_are_distinct_snake_case_words() -> None:
    assert len(set(errors.ALL_CODES)) == len(errors.ALL_CODES)
    assert all(re.fullmatch(r"[a-z]+(_[a-z]+)*", code) for code in errors.ALL_CODES), errors.ALL_CODES
