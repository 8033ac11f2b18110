"""Token buckets, pure: the per-connection message limit, and by key (a user, an address) the limits a
hub keeps in its own memory. (The per-user grab limit, shared by every hub, is the same arithmetic inside
``lua/grab.lua``.)"""

from __future__ import annotations

from collections import OrderedDict


class TokenBucket:
    def __init__(self, rate: float, burst: int, now: float) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = float(burst)
        self.last = now

    def take(self, now: float) -> bool:
        """Spend one token if there is one; ``now`` in seconds, from a monotonic clock."""
        self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
        self.last = now
        if self.tokens >= 1:
            self.tokens -= 1
            return True
        return False

    def wait(self, now: float) -> float:
        """Seconds from ``now`` until ``take`` would succeed (0: it would now)."""
        tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
        return 0.0 if tokens >= 1 else (1 - tokens) / self.rate


class KeyedBuckets:
    """A ``TokenBucket`` per key, made full on first use. At most ``most`` keys are kept: the one used
    longest ago is forgotten first (it comes back full), so memory stays bounded whatever the keys."""

    def __init__(self, rate: float, burst: int, most: int = 100_000) -> None:
        self.rate = rate
        self.burst = burst
        self.most = most
        self._buckets: OrderedDict[object, TokenBucket] = OrderedDict()

    def allows(self, key: object, now: float) -> bool:
        """Whether ``take`` would succeed now (nothing is spent)."""
        bucket = self._buckets.get(key)
        if bucket is None:
            return self.burst >= 1
        return min(bucket.burst, bucket.tokens + (now - bucket.last) * bucket.rate) >= 1

    def wait(self, key: object, now: float) -> float:
        """Seconds from ``now`` until ``take`` of ``key`` would succeed (what a 429 says: Retry-After)."""
        bucket = self._buckets.get(key)
        return 0.0 if bucket is None else bucket.wait(now)

    def take(self, key: object, now: float) -> bool:
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = TokenBucket(self.rate, self.burst, now)
            if len(self._buckets) > self.most:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(key)
        return bucket.take(now)

    def __len__(self) -> int:
        return len(self._buckets)
