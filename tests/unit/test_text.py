"""``server.text``, pure: what text each field takes, and the message walk every frame goes through."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from server import text

ZWJ, ZWNJ, ZWSP, BOM, LRM = "\u200d", "\u200c", "\u200b", "\ufeff", "\u200e"
OVERRIDES = ["\u202a", "\u202b", "\u202c", "\u202d", "\u202e", "\u2066", "\u2067", "\u2068", "\u2069"]
CONTROLS = ["\x00", "\x07", "\x1b", "\x7f", "\x85", "\r", "\u2028", "\u2029"]
FAMILY = f"👩{ZWJ}👩{ZWJ}👧"


@pytest.mark.parametrize("bad", [*CONTROLS, *OVERRIDES, "\n", "\t"])
def test_no_field_takes_controls_or_direction_overrides_but_chat_takes_lines_and_tabs(bad: str) -> None:
    said = f"恭喜{bad}发财"
    assert not text.name_ok(said) and not text.greeting_ok(said) and not text.request_id_ok(said)
    assert text.chat_ok(said) is (bad in "\n\t")


def test_a_name_takes_no_invisible_formatting_but_the_joiners_emoji_need() -> None:
    assert text.name_ok(FAMILY) and text.name_ok(f"می{ZWNJ}خواهم") and text.name_ok("Zoë 王")
    for invisible in (ZWSP, BOM, LRM, "\u2060", "\u00ad"):
        assert not text.name_ok(f"wang{invisible}"), repr(invisible)
        assert text.greeting_ok(f"hi{invisible}")  # a greeting may: it names nobody


def test_a_request_id_is_compared_byte_for_byte_so_nothing_in_it_may_hide() -> None:
    assert text.request_id_ok("send 2024-01-01 #3")
    for hidden in (" lead", "trail ", "\u3000wide", f"a{ZWSP}b", f"{ZWJ}", "a\u00a0"):
        assert not text.request_id_ok(hidden), repr(hidden)


def test_lone_surrogates_are_found_wherever_they_are() -> None:
    assert text.has_surrogates("a\ud800") and text.has_surrogates("\udfff")
    assert not text.has_surrogates("😀 emoji are pairs, not lone halves")
    for where in ({"k": "\ud800"}, {"\udc00": 1}, ["ok", ("\ud801",)], "\ud83d"):
        assert text.message_problem(where, 8) is not None, where
    assert text.message_problem({"k": ["😀", {"n": 1}]}, 8) is None


def test_a_message_may_be_nested_up_to_the_limit_and_a_deep_one_costs_no_stack() -> None:
    def nested(depth: int) -> Any:
        value: Any = "leaf"
        for n in range(depth):
            value = {"k": value} if n % 2 else [value]
        return value

    assert text.message_problem(nested(5), 5) is None
    assert text.message_problem(nested(6), 5) == "nested deeper than 5 maps and lists"
    assert text.message_problem(nested(200_000), 64) is not None  # far past Python's recursion limit
    assert text.message_problem("a plain string", 0) is None


@given(st.text(alphabet=st.characters(codec="ascii", categories=("L", "N")), min_size=1, max_size=64))
def test_a_plain_device_id_is_kept_as_given(device: str) -> None:
    assert text.device_id(device) == device


def test_any_other_device_id_is_kept_only_as_a_stable_hash() -> None:
    assert text.device_id("") == ""
    assert text.device_id("iphone-15:A1B2/x@y+z=._") == "iphone-15:A1B2/x@y+z=._"
    for raw in ("x" * 65, "has space", "\x1b[2J", "télé", "\ud800"):
        hashed = text.device_id(raw)
        assert hashed.startswith("h:") and len(hashed) == 34 and raw not in hashed, raw
        assert text.device_id(raw) == hashed  # the same device is told apart the same way every time
    assert text.device_id("x" * 65) != text.device_id("x" * 66)


@given(st.text(alphabet=st.characters(blacklist_categories=("Cc", "Cf", "Cs", "Zl", "Zp")), max_size=20))
def test_text_policy_takes_printable_text_and_refuses_any_control(s: str) -> None:
    assert text.name_ok(s) and text.greeting_ok(s) and text.chat_ok(s)
    for bad in ["\x00", "\x1b", "\x85", "\u202e", "\u2067", "\u2029"]:
        mixed = s[: len(s) // 2] + bad + s[len(s) // 2 :]
        assert not text.name_ok(mixed) and not text.greeting_ok(mixed) and not text.chat_ok(mixed)
    assert not text.name_ok(s + "\u200b") and text.chat_ok(s + "\n\t")


def test_device_ids_are_kept_when_plain_and_hashed_when_not() -> None:
    assert text.device_id("") == ""
    assert text.device_id("iphone-15:A1B2") == "iphone-15:A1B2"
    hashed = text.device_id("\x1b[2J" + "x" * 100)
    assert hashed.startswith("h:") and len(hashed) == 34 and hashed == text.device_id("\x1b[2J" + "x" * 100)
    assert text.device_id("\ud800") != text.device_id("\udfff")
