"""The provably fair split's statistics over 10^5 packets: exact, and fair by position; and the same check
failing on the draws left unshuffled. Pure, but seconds of CPU: kept out of the fast tier (``-m unit``)."""

from __future__ import annotations

import hashlib

from redpacket_client.fairness import Stream, double_average, fair_shares

SPLITS = 100_000


def _unfair_positions(splits: list[list[int]], total: int, count: int) -> list[str]:
    """The positions whose mean share, or whose chance of being the (first) largest, is off."""
    n = len(splits)
    best = [0] * count
    for s in splits:
        best[s.index(max(s))] += 1
    off = []
    for i in range(count):
        mean = sum(s[i] for s in splits) / n
        # A share's spread is under 60 cents: 4 standard errors of a mean of 10^5 is under 0.8 cent.
        if abs(mean - total / count) >= 1.0:
            off.append(f"position {i}: mean {mean:.2f}")
        # 1 in 10 at every position: 6 standard errors of a proportion of 10^5 is under 0.006.
        if abs(best[i] / n - 1 / count) >= 0.006:
            off.append(f"position {i}: the largest {best[i] / n:.4f} of the time")
    return off


def _seed(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(4, "big")).digest()


def test_ten_to_the_fifth_splits_are_exact_and_fair_by_position() -> None:
    total, count = 1_000, 10
    splits = [fair_shares(_seed(i), i, "lucky", total, count) for i in range(SPLITS)]
    assert all(sum(s) == total and min(s) >= 1 and len(s) == count for s in splits)
    assert _unfair_positions(splits, total, count) == []


def test_the_fairness_check_catches_a_split_left_unshuffled() -> None:
    # The check above can fail: the double-average draws in their own order make the first and the
    # last positions the likelier luckiest, which is why the split shuffles them.
    total, count = 1_000, 10
    splits = [double_average(total, count, Stream(_seed(i), i, total, count).below) for i in range(SPLITS)]
    assert all(sum(s) == total for s in splits)
    assert _unfair_positions(splits, total, count) != []
