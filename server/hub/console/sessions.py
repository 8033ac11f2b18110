"""Console sign-ins: the operators' key (``REDPACKET_CONSOLE_KEY``) is given once and exchanged for a
session token that expires (``REDPACKET_CONSOLE_SESSION_MINUTES``). A token is its expiry and a random id,
signed with HMAC-SHA256 under a key derived from the console key: any hub process of the deployment
takes it, none stores it, and changing the console key ends every session. Pure."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from typing import Literal

PREFIX = "rpc1"

Check = Literal["ok", "invalid", "expired"]


@dataclass(frozen=True)
class Session:
    token: str
    id: str  # what the log says of the operator's actions (never the token)
    expires_ms: int


def _signing_key(console_key: str) -> bytes:
    return hmac.new(console_key.encode(), b"redpacket console sessions", hashlib.sha256).digest()


def _mac(console_key: str, body: str) -> str:
    return hmac.new(_signing_key(console_key), body.encode(), hashlib.sha256).hexdigest()


def open_session(console_key: str, now_ms: int, minutes: int) -> Session:
    sid = secrets.token_hex(8)
    expires = now_ms + minutes * 60_000
    body = f"{PREFIX}.{expires}.{sid}"
    return Session(f"{body}.{_mac(console_key, body)}", sid, expires)


def check(console_key: str, token: str, now_ms: int) -> tuple[Check, str]:
    """Whether ``token`` is a session this console key signed and has not expired, and its id."""
    parts = token.split(".")
    if not console_key or len(parts) != 4 or parts[0] != PREFIX or not parts[1].isdigit():
        return "invalid", ""
    body = ".".join(parts[:3])
    if not hmac.compare_digest(parts[3].encode(), _mac(console_key, body).encode()):
        return "invalid", ""
    if int(parts[1]) <= now_ms:
        return "expired", parts[2]
    return "ok", parts[2]
