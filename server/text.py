"""What text the system accepts and stores: names, greetings, chat, device ids. Pure: no I/O.

Every message that reaches a handler came through ``message_problem``: no lone surrogates (JSON can carry
``"\\ud800"``; no database, msgpack or UTF-8 page can store it), so the rest of the system sees only text
that encodes. On top of that, per kind of text:

- **names** (users, groups): no control characters at all, no invisible formatting characters (zero-width
  spaces, byte-order marks, direction marks and overrides) except the zero-width (non-)joiner that
  emoji sequences and some scripts need. A name is how people recognise each other: it must look like
  what it is.
- **greetings**: no control characters, no bidi embeddings, overrides or isolates (U+202A–U+202E,
  U+2066–U+2069), which reorder the text shown after them.
- **chat**: as greetings, but line feeds and tabs are allowed.
- **request ids** (idempotency keys a client chooses): no control or invisible formatting characters and
  no whitespace at either end. A key is compared byte for byte; one that differs from another only by
  what nobody can see is refused rather than taken for a new request.

Refused text moves nothing and gets the field's own error code.
"""

from __future__ import annotations

import hashlib
import itertools
import re
import unicodedata
from typing import Any

_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_PROBLEM = "a string holds a lone surrogate (\\ud800-\\udfff): not text"
# Embeddings, overrides and isolates: they change how everything after them is drawn.
_BIDI_CONTROLS = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
_JOINERS = frozenset("\u200c\u200d")
_DEVICE = re.compile(r"[A-Za-z0-9._:@/+=-]{1,64}", re.ASCII)


def has_surrogates(value: str) -> bool:
    """True if the string holds a lone surrogate."""
    return _SURROGATE.search(value) is not None


def message_problem(value: Any, max_depth: int) -> str | None:
    """Why a decoded message (JSON or msgpack: an HTTP body, a websocket frame) is not one the system
    takes, or None: nested deeper than ``max_depth`` maps and lists, or a string (a key included) holding
    a lone surrogate. Walked without recursion: a message nested a thousand deep costs a loop, not a
    stack. (Every request passes here: an ASCII string, which cannot hold one, is not searched.)"""
    todo: list[tuple[Any, int]] = [(value, 1)]
    while todo:
        v, depth = todo.pop()
        if isinstance(v, str):
            if not v.isascii() and _SURROGATE.search(v) is not None:
                return _SURROGATE_PROBLEM
            continue
        if not isinstance(v, dict | list | tuple):
            continue
        if depth > max_depth:
            return f"nested deeper than {max_depth} maps and lists"
        for x in itertools.chain(v.keys(), v.values()) if isinstance(v, dict) else v:
            if isinstance(x, str):
                if not x.isascii() and _SURROGATE.search(x) is not None:
                    return _SURROGATE_PROBLEM
            elif isinstance(x, dict | list | tuple):
                todo.append((x, depth + 1))
    return None


def _refused(ch: str, allow: frozenset[str]) -> bool:
    if ch in allow:
        return False
    category = unicodedata.category(ch)
    return category in ("Cc", "Zl", "Zp", "Cs") or ch in _BIDI_CONTROLS


def name_ok(name: str) -> bool:
    """A user or group name: printable, with no invisible formatting besides the two joiners."""
    return not any(
        _refused(ch, frozenset()) or (unicodedata.category(ch) == "Cf" and ch not in _JOINERS) for ch in name
    )


def greeting_ok(greeting: str) -> bool:
    return not any(_refused(ch, frozenset()) for ch in greeting)


_CHAT_ALLOWED = frozenset("\n\t")


def chat_ok(text: str) -> bool:
    return not any(_refused(ch, _CHAT_ALLOWED) for ch in text)


def request_id_ok(key: str) -> bool:
    return key == key.strip() and not any(
        _refused(ch, frozenset()) or unicodedata.category(ch) == "Cf" for ch in key
    )


def device_id(raw: str) -> str:
    """The device id the bot detector keys on. A plain one (letters, digits, ``._:@/+=-``, at most 64) is
    kept as given; anything else is replaced by a hash of it, so the detector still tells devices
    apart but never stores or prints what a client chose to send (escape sequences, say)."""
    if not raw or _DEVICE.fullmatch(raw):
        return raw
    return "h:" + hashlib.sha256(raw.encode("utf-8", "surrogatepass")).hexdigest()[:32]
