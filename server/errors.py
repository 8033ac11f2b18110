"""One exception tree. Every error carries a stable ``code``: the same string a client sees on the wire.

RedPacketError
├── InvalidRequest        bad input: nothing was written, no money moved
├── Forbidden             the user may not do this (not a member, not an admin, not the target)
├── NotFound              unknown packet, group or user
├── Conflict              the state refuses it (insufficient funds, expired, all grabbed)
├── TooMany               past a rate or count limit: slow down (HTTP 429)
└── Unavailable           a backing service is down; safe to retry
"""

from __future__ import annotations

from typing import Any


class RedPacketError(Exception):
    code = "error"

    def __init__(self, code: str, message: str = "", **details: Any) -> None:
        super().__init__(message or code)
        self.code = code
        self.message = message or code
        # Facts a client words its own message with (``limit``, ``names``): sent beside code and message.
        self.details = details

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.code!r}, {self.message!r})"


class InvalidRequest(RedPacketError):
    pass


class Forbidden(RedPacketError):
    pass


class NotFound(RedPacketError):
    pass


class Conflict(RedPacketError):
    pass


class TooMany(RedPacketError):
    """A limit reached: ``retry_after_s`` until the next request would be taken, ``allowance`` the requests
    the limit takes at once (HTTP answers say both: ``Retry-After``, ``RateLimit-*``)."""

    def __init__(
        self, code: str, message: str = "", *, retry_after_s: float = 1.0, allowance: int = 1, **details: Any
    ) -> None:
        super().__init__(code, message, **details)
        self.retry_after_s = retry_after_s
        self.allowance = allowance


class Unavailable(RedPacketError):
    pass


# The stable codes, in one place so that docs and clients can list them (``ALL_CODES`` below).
AMOUNT_INVALID = "amount_invalid"
AMOUNT_TOO_LARGE = "amount_too_large"
COUNT_INVALID = "count_invalid"
COUNT_TOO_LARGE = "count_too_large"
COUNT_EXCEEDS_AMOUNT = "count_exceeds_amount"
EQUAL_NOT_DIVISIBLE = "equal_not_divisible"
KIND_INVALID = "kind_invalid"
GREETING_TOO_LONG = "greeting_too_long"
GREETING_INVALID = "greeting_invalid"
TARGET_INVALID = "target_invalid"
NAME_INVALID = "name_invalid"
NAME_TAKEN = "name_taken"
ROLE_INVALID = "role_invalid"
IDEMPOTENCY_KEY_REUSED = "idempotency_key_reused"
INSUFFICIENT_FUNDS = "insufficient_funds"
NOT_MEMBER = "not_member"
NOT_ADMIN = "not_admin"
NOT_TARGET = "not_target"
USER_NOT_FOUND = "user_not_found"
GROUP_NOT_FOUND = "group_not_found"
PACKET_NOT_FOUND = "packet_not_found"
PACKET_EXPIRED = "packet_expired"
PACKET_EMPTY = "packet_empty"
SHARE_CONFLICT = "share_conflict"
REDIS_UNAVAILABLE = "redis_unavailable"
DATABASE_UNAVAILABLE = "database_unavailable"
AUTH_UNAVAILABLE = "auth_unavailable"
BAD_REQUEST = "bad_request"
TOKEN_INVALID = "token_invalid"
TOKEN_EXPIRED = "token_expired"
UNKNOWN_TYPE = "unknown_type"
BAD_FRAME = "bad_frame"
RATE_LIMITED = "rate_limited"
BLOCKED = "blocked"
TEXT_INVALID = "text_invalid"
DISABLED = "disabled"
INTERNAL = "internal"
NOT_FOUND = "not_found"
REQUEST_TIMEOUT = "request_timeout"
REQUEST_TOO_LARGE = "request_too_large"
METHOD_NOT_ALLOWED = "method_not_allowed"
MANAGED_BY_BACKEND = "managed_by_backend"
ID_TAKEN = "id_taken"
NOT_LOCAL = "not_local"
ORIGIN_NOT_ALLOWED = "origin_not_allowed"
DENIED_BY_BACKEND = "denied_by_backend"
HOOK_UNAVAILABLE = "hook_unavailable"
HOLD_NOT_FOUND = "hold_not_found"
HOLD_CLOSED = "hold_closed"
WEBHOOK_NOT_FOUND = "webhook_not_found"

# Every code above, read from this module: a code added above is in it, with nothing else to edit.
ALL_CODES: tuple[str, ...] = tuple(
    value for name, value in list(globals().items()) if name.isupper() and isinstance(value, str)
)
# Codes the ledger records (``credit_refusals.code``, what ``redpacket reconcile`` reports), never sent to
# a client: a credit refused because its share is paid to another grab.
LEDGER_CODES = (SHARE_CONFLICT,)
# What a client may be answered: docs/protocol.md's table of error codes lists exactly these.
WIRE_CODES = tuple(c for c in ALL_CODES if c not in LEDGER_CODES)
