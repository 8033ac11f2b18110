"""``db.backoff_window``: the wait before a transaction runs again is measured in the failed attempt's own
duration, so conflicting writers spread out on a slow machine as on a fast one, and is bounded."""

from __future__ import annotations

import pytest

from server.store.db import BACKOFF_MAX_S, BACKOFF_S, BACKOFF_UNIT_MAX_S, backoff_window


def test_the_window_doubles_each_attempt_in_units_of_the_attempts_duration() -> None:
    assert [backoff_window(a, 0.001) for a in range(1, 6)] == [BACKOFF_S * 2**a for a in range(1, 6)]
    fast = [backoff_window(a, 0.005) for a in range(1, 6)]
    slow = [backoff_window(a, 0.050) for a in range(1, 6)]
    assert slow == pytest.approx([0.050 * 2**a for a in range(1, 6)])
    # Ten times as slow, ten times the window (until the cap): the same odds of meeting a rival again.
    assert slow[:3] == pytest.approx([10 * f for f in fast[:3]])


def test_the_window_is_bounded_whatever_the_attempt_took() -> None:
    assert backoff_window(1, 50.0) == BACKOFF_UNIT_MAX_S * 2  # a 50 s lock wait is no unit
    assert (
        max(backoff_window(a, took) for a in range(1, 30) for took in (0.0, 0.01, 1.0, 60.0)) == BACKOFF_MAX_S
    )
