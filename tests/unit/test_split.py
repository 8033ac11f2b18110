"""The split, property by property, over the whole range of totals and counts."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from redpacket_client.fairness import double_average, split
from server import errors
from server.errors import InvalidRequest
from server.money.split import Limits, validate_request


def _below(seed: int) -> Callable[[int], int]:
    return random.Random(seed).randrange


LIMITS = Limits(max_count=100, max_total_cents=20_000, max_greeting_chars=64)


@st.composite
def totals_and_counts(draw: st.DrawFn) -> tuple[int, int]:
    count = draw(st.integers(1, LIMITS.max_count))
    total = draw(st.integers(count, LIMITS.max_total_cents))
    return total, count


@given(totals_and_counts(), st.integers(0, 2**32))
@settings(max_examples=500)
def test_double_average_sums_exactly_and_bounds_every_draw(tc: tuple[int, int], seed: int) -> None:
    total, count = tc
    draws = double_average(total, count, _below(seed))
    assert len(draws) == count
    assert sum(draws) == total
    assert all(isinstance(d, int) and d >= 1 for d in draws)
    remaining = total
    for left, d in zip(range(count, 0, -1), draws, strict=True):
        # Each draw lies in [1, 2 × the average of what remains]: d ≤ 2·remaining/left.
        assert d * left <= 2 * remaining
        remaining -= d


@given(totals_and_counts(), st.integers(0, 2**32))
@settings(max_examples=300)
def test_lucky_split_is_a_permutation_summing_to_total(tc: tuple[int, int], seed: int) -> None:
    total, count = tc
    validate_request("lucky", total, count, "", None, LIMITS)
    shares = split("lucky", total, count, _below(seed))
    assert sorted(shares) == sorted(double_average(total, count, _below(seed)))
    assert sum(shares) == total and len(shares) == count and min(shares) >= 1


@given(st.integers(1, LIMITS.max_count), st.integers(1, 200))
def test_equal_split_is_exact(count: int, each: int) -> None:
    total = count * each
    if total > LIMITS.max_total_cents:
        return
    validate_request("equal", total, count, "", None, LIMITS)
    shares = split("equal", total, count, _below(0))
    assert shares == [each] * count


def test_edges_of_the_range() -> None:
    below = _below(7)
    assert double_average(1, 1, below) == [1]
    assert double_average(100, 100, below) == [1] * 100
    assert sum(double_average(LIMITS.max_total_cents, LIMITS.max_count, below)) == LIMITS.max_total_cents
    assert split("exclusive", 888, 1, below) == [888]


def test_a_lucky_split_actually_varies() -> None:
    # A split that always returned equal shares would pass the sum checks; it must not.
    shares = split("lucky", 10_000, 10, _below(1))
    assert len(set(shares)) > 1


@pytest.mark.parametrize(
    ("kind", "total", "count", "greeting", "target", "code"),
    [
        ("lucky", 0, 1, "", None, errors.AMOUNT_INVALID),
        ("lucky", -5, 1, "", None, errors.AMOUNT_INVALID),
        ("lucky", 10.5, 1, "", None, errors.AMOUNT_INVALID),
        ("lucky", "100", 1, "", None, errors.AMOUNT_INVALID),
        ("lucky", True, 1, "", None, errors.AMOUNT_INVALID),
        ("lucky", None, 1, "", None, errors.AMOUNT_INVALID),
        ("lucky", 20_001, 1, "", None, errors.AMOUNT_TOO_LARGE),
        ("lucky", 10**30, 1, "", None, errors.AMOUNT_TOO_LARGE),
        ("lucky", 100, 0, "", None, errors.COUNT_INVALID),
        ("lucky", 100, -1, "", None, errors.COUNT_INVALID),
        ("lucky", 100, 2.0, "", None, errors.COUNT_INVALID),
        ("lucky", 1000, 101, "", None, errors.COUNT_TOO_LARGE),
        ("lucky", 5, 6, "", None, errors.COUNT_EXCEEDS_AMOUNT),
        ("equal", 100, 3, "", None, errors.EQUAL_NOT_DIVISIBLE),
        ("weird", 100, 1, "", None, errors.KIND_INVALID),
        ("lucky", 100, 1, "x" * 65, None, errors.GREETING_TOO_LONG),
        ("lucky", 100, 1, 42, None, errors.GREETING_INVALID),
        ("exclusive", 100, 2, "", 5, errors.COUNT_INVALID),
        ("exclusive", 100, 1, "", None, errors.TARGET_INVALID),
        ("lucky", 100, 1, "", 5, errors.TARGET_INVALID),
    ],
)
def test_bad_requests_have_stable_codes(
    kind: object, total: object, count: object, greeting: object, target: object, code: str
) -> None:
    with pytest.raises(InvalidRequest) as e:
        validate_request(kind, total, count, greeting, target, LIMITS)
    assert e.value.code == code
