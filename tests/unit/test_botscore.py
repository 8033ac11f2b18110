"""Bot scoring is a pure function: every rule, its thresholds and how decisions combine."""

from __future__ import annotations

from server.live.botscore import Attempt, Rules, score

NOW = 1_800_000_000_000
RULES = Rules()


def a(user: int, reaction: int | None = 900, device: str = "", ms: int = NOW, group: int = 1) -> Attempt:
    return Attempt(user=user, group=group, packet=1, reaction_ms=reaction, device=device or f"d{user}", ms=ms)


def test_humans_are_left_alone() -> None:
    assert score([a(1), a(2, reaction=150), a(3, reaction=None)], RULES, NOW) == {}


def test_fast_reactions_throttle_then_block() -> None:
    d = score([a(1, reaction=40)], RULES, NOW)
    assert d[1].action == "throttle" and d[1].seconds == RULES.throttle_seconds
    d = score([a(1, reaction=40), a(1, reaction=10), a(1, reaction=99)], RULES, NOW)
    assert d[1].action == "block" and d[1].seconds == RULES.block_seconds
    # Exactly at the threshold is human.
    assert score([a(1, reaction=RULES.min_reaction_ms)], RULES, NOW) == {}


def test_too_many_grabs_across_groups() -> None:
    many = [a(7, group=g % 5, ms=NOW - g * 100) for g in range(RULES.max_grabs_per_minute + 1)]
    assert score(many, RULES, NOW)[7].action == "throttle"
    assert score(many[:-1], RULES, NOW) == {}


def test_many_accounts_on_one_device_are_blocked() -> None:
    farm = [a(u, device="phone-1") for u in range(10, 10 + RULES.max_accounts_per_device + 1)]
    d = score(farm, RULES, NOW)
    assert set(d) == {10, 11, 12, 13} and {x.action for x in d.values()} == {"block"}
    assert score(farm[:-1], RULES, NOW) == {}


def test_old_attempts_do_not_count_and_a_block_outranks_a_throttle() -> None:
    assert score([a(1, reaction=5, ms=NOW - 61_000)], RULES, NOW) == {}
    mixed = [a(2, reaction=5, device="x"), *[a(u, device="x") for u in range(3, 6)]]
    d = score(mixed, RULES, NOW)
    assert d[2].action == "block" and len(d[2].reasons) == 2
