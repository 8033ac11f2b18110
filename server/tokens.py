"""Signed, expiring tokens that open a websocket or call the HTTP API. Pure: no I/O.

A token is ``<user id>.<expires unix s>.<hex HMAC-SHA256 of "user.expires">``, signed with the hub's
secret. Only the holder of the secret can mint one; any change to a field breaks the signature.
"""

from __future__ import annotations

import hashlib
import hmac
import re

from server import errors
from server.errors import RedPacketError
from server.protocol import MAX_ID


class TokenError(RedPacketError):
    pass


# ASCII digits only (``str.isdigit`` also takes "²" and other scripts' digits), a user id that fits a
# signed 64-bit column, and a lowercase hex SHA-256.
_SHAPE = re.compile(r"([1-9][0-9]{0,18})\.([0-9]{1,12})\.([0-9a-f]{64})", re.ASCII)


def _sign(secret: bytes, body: str) -> str:
    return hmac.new(secret, body.encode(), hashlib.sha256).hexdigest()


def make_token(secret: bytes, user_id: int, now: int, ttl_seconds: int) -> str:
    body = f"{user_id}.{now + ttl_seconds}"
    return f"{body}.{_sign(secret, body)}"


def verify_token(secret: bytes, token: object, now: int) -> int:
    """The user id the token was made for; ``TokenError`` if it is malformed, tampered or expired."""
    shape = _SHAPE.fullmatch(token) if isinstance(token, str) and len(token) <= 200 else None
    if shape is None or int(shape[1]) > MAX_ID:
        raise TokenError(errors.TOKEN_INVALID, "malformed token")
    user, expires, signature = shape.groups()
    if not hmac.compare_digest(_sign(secret, f"{user}.{expires}"), signature):
        raise TokenError(errors.TOKEN_INVALID, "bad signature")
    if int(expires) <= now:
        raise TokenError(errors.TOKEN_EXPIRED, "token expired")
    return int(user)
