"""Pure money arithmetic: validating a packet request, before its total is split into shares.

No I/O. Everything is integer cents. The split itself is the protocol's (``redpacket_client.fairness``:
every client can recompute it from the seed shown once the packet is over), drawn from the packet's
committed seed; what reaches it has passed ``validate_request``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeGuard

from redpacket_client.fairness import KINDS, Kind
from server import errors, text
from server.errors import InvalidRequest
from server.ids import MAX_ID


@dataclass(frozen=True)
class Limits:
    max_count: int
    max_total_cents: int
    max_greeting_chars: int


@dataclass(frozen=True)
class PacketRequest:
    """A validated request to send a packet; only ``validate_request`` builds one."""

    kind: Kind
    total: int
    count: int
    greeting: str
    target_user_id: int | None


def _is_int(v: object) -> TypeGuard[int]:
    # bool is an int subclass; True cents is not money.
    return isinstance(v, int) and not isinstance(v, bool)


def validate_request(
    kind: object,
    total: object,
    count: object,
    greeting: object,
    target_user_id: object,
    limits: Limits,
) -> PacketRequest:
    """Check every field of a send request; raise ``InvalidRequest`` with a stable code on the first fault."""
    if kind not in KINDS:
        raise InvalidRequest(errors.KIND_INVALID, f"kind must be one of {', '.join(KINDS)}")
    if not _is_int(total) or total <= 0:
        raise InvalidRequest(errors.AMOUNT_INVALID, "total must be a positive whole number of cents")
    if total > limits.max_total_cents:
        raise InvalidRequest(
            errors.AMOUNT_TOO_LARGE,
            f"total must be at most {limits.max_total_cents} cents",
            limit=limits.max_total_cents,
        )
    if kind == "exclusive" and count is None:
        count = 1
    if not _is_int(count) or count <= 0:
        raise InvalidRequest(errors.COUNT_INVALID, "count must be a positive whole number")
    if count > limits.max_count:
        raise InvalidRequest(
            errors.COUNT_TOO_LARGE, f"count must be at most {limits.max_count}", limit=limits.max_count
        )
    if count > total:
        raise InvalidRequest(errors.COUNT_EXCEEDS_AMOUNT, "every share needs at least one cent")
    if kind == "equal" and total % count != 0:
        raise InvalidRequest(
            errors.EQUAL_NOT_DIVISIBLE, f"{total} cents cannot be split into {count} equal shares"
        )
    if greeting is None:
        greeting = ""
    if not isinstance(greeting, str):
        raise InvalidRequest(errors.GREETING_INVALID, "greeting must be text")
    if len(greeting) > limits.max_greeting_chars:
        raise InvalidRequest(
            errors.GREETING_TOO_LONG,
            f"greeting must be at most {limits.max_greeting_chars} characters",
            limit=limits.max_greeting_chars,
        )
    if not text.greeting_ok(greeting):
        raise InvalidRequest(
            errors.GREETING_INVALID, "a greeting may not hold control characters or direction overrides"
        )
    if kind == "exclusive":
        if count != 1:
            raise InvalidRequest(errors.COUNT_INVALID, "an exclusive packet has exactly one share")
        if not _is_int(target_user_id) or not 1 <= target_user_id <= MAX_ID:
            raise InvalidRequest(errors.TARGET_INVALID, "an exclusive packet needs a target user")
        target: int | None = target_user_id
    else:
        if target_user_id is not None:
            raise InvalidRequest(errors.TARGET_INVALID, "only exclusive packets have a target user")
        target = None
    return PacketRequest(kind=kind, total=total, count=count, greeting=greeting, target_user_id=target)
