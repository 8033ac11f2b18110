"""A token bucket, pure: the per-connection message limit. (The per-user grab limit, shared by every
hub, is the same arithmetic inside ``lua/grab.lua``.)"""

from __future__ import annotations


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
