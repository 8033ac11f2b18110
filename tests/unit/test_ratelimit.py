"""``server.hub.ratelimit``, pure: token buckets on the test's clock (every call is given ``now``)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from server.hub.ratelimit import KeyedBuckets, TokenBucket


def test_a_bucket_starts_full_spends_its_burst_then_refills_at_its_rate() -> None:
    b = TokenBucket(rate=2.0, burst=3, now=100.0)
    assert [b.take(100.0) for _ in range(4)] == [True, True, True, False]
    assert b.take(100.4) is False  # 0.8 of a token
    assert b.take(100.5) is True  # one token after half a second at 2/s
    assert b.take(100.5) is False


def test_a_bucket_left_alone_refills_to_its_burst_and_no_more() -> None:
    b = TokenBucket(rate=10.0, burst=2, now=0.0)
    assert b.take(0.0) and b.take(0.0) and not b.take(0.0)
    assert [b.take(3600.0) for _ in range(3)] == [True, True, False]


@given(st.lists(st.floats(0, 5), max_size=200), st.floats(0.1, 50), st.integers(1, 20))
def test_a_bucket_never_gives_more_than_its_burst_plus_what_its_rate_earned(
    gaps: list[float], rate: float, burst: int
) -> None:
    now = 0.0
    b = TokenBucket(rate, burst, now)
    taken = 0
    for gap in gaps:
        now += gap
        taken += b.take(now)
    assert taken <= burst + rate * now + 1e-9


def test_each_key_has_its_own_bucket_and_allows_spends_nothing() -> None:
    buckets = KeyedBuckets(rate=1.0, burst=2)
    assert buckets.allows("user:1", 0.0) and len(buckets) == 0  # a key never used is full
    assert buckets.take("user:1", 0.0) and buckets.take("user:1", 0.0)
    assert not buckets.allows("user:1", 0.0) and not buckets.take("user:1", 0.0)
    assert buckets.take("10.0.0.7", 0.0)  # another key: its own allowance
    assert not buckets.allows("user:1", 0.5)
    assert buckets.allows("user:1", 1.0) and buckets.allows("user:1", 1.0)  # asking twice spends nothing
    assert buckets.take("user:1", 1.0) and not buckets.take("user:1", 1.0)
    assert not KeyedBuckets(rate=1.0, burst=0).allows("anyone", 0.0)


def test_keys_kept_are_bounded_and_the_least_recently_used_comes_back_full() -> None:
    buckets = KeyedBuckets(rate=0.001, burst=1, most=3)
    for key in ("a", "b", "c"):
        assert buckets.take(key, 0.0)
    assert not buckets.take("a", 0.0)  # used again: "a" is now the most recent, "b" the least
    assert buckets.take("d", 0.0)  # a fourth key: "b" is forgotten
    assert len(buckets) == 3
    assert not buckets.take("a", 0.0) and not buckets.take("c", 0.0)  # remembered: still empty
    assert buckets.take("b", 0.0)  # forgotten, so full again: a looser limit, never a stricter one
    for n in range(1_000):
        buckets.take(("stranger", n), 0.0)
        assert len(buckets) <= 3
