"""Bot scoring, pure: grab attempts in, throttles and blocks out. No I/O; the worker feeds it.

Signals (each threshold a field of ``Rules``):
  - reactions faster than a human can: a grab sooner than ``min_reaction_ms`` after the packet was shown
    to that connection;
  - too many grabs across groups in a minute;
  - many accounts grabbing from one device.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from server.ids import GroupId, PacketId, UserId


@dataclass(frozen=True, kw_only=True)
class Attempt:
    """One grab attempt (built by name: three ids in a row are a swap waiting to happen)."""

    user: UserId
    group: GroupId
    packet: PacketId
    reaction_ms: int | None  # None when the connection never saw the packet announced
    device: str
    ms: int


@dataclass(frozen=True)
class Rules:
    min_reaction_ms: int = 100
    fast_to_throttle: int = 1
    fast_to_block: int = 3
    max_grabs_per_minute: int = 30
    max_accounts_per_device: int = 3
    throttle_seconds: int = 300
    block_seconds: int = 3600
    throttled_grabs_per_second: float = 0.2
    # Never scored: REDPACKET_BOT_EXEMPT_USERS (a chat backend's own scripted clients).
    exempt: frozenset[int] = frozenset()


@dataclass
class Decision:
    user: int
    action: str  # "throttle" | "block"
    seconds: int
    reasons: list[str] = field(default_factory=list)


# The detector judges the grab attempts of the last minute.
WINDOW_MS = 60_000


def score(attempts: list[Attempt], rules: Rules, now_ms: int) -> dict[int, Decision]:
    """Decisions for the users in ``attempts`` (the last minute of them); a block outranks a throttle."""
    out: dict[int, Decision] = {}

    def decide(user: int, action: str, reason: str) -> None:
        seconds = rules.block_seconds if action == "block" else rules.throttle_seconds
        d = out.get(user)
        if d is None:
            out[user] = Decision(user, action, seconds, [reason])
            return
        d.reasons.append(reason)
        if action == "block" and d.action != "block":
            d.action, d.seconds = "block", seconds

    recent = [a for a in attempts if now_ms - a.ms <= WINDOW_MS and a.user not in rules.exempt]
    fast: dict[int, int] = defaultdict(int)
    per_user: dict[int, int] = defaultdict(int)
    per_device: dict[str, set[int]] = defaultdict(set)
    for a in recent:
        per_user[a.user] += 1
        if a.device:
            per_device[a.device].add(a.user)
        if a.reaction_ms is not None and a.reaction_ms < rules.min_reaction_ms:
            fast[a.user] += 1
    for user, n in fast.items():
        if n >= rules.fast_to_block:
            decide(user, "block", f"{n} grabs faster than {rules.min_reaction_ms} ms")
        elif n >= rules.fast_to_throttle:
            decide(user, "throttle", f"{n} grab(s) faster than {rules.min_reaction_ms} ms")
    for user, n in per_user.items():
        if n > rules.max_grabs_per_minute:
            decide(user, "throttle", f"{n} grabs in a minute")
    for device, users in per_device.items():
        if len(users) > rules.max_accounts_per_device:
            for user in users:
                decide(user, "block", f"{len(users)} accounts on device {device}")
    return out
