"""Small fakes for the fast tier: a clock the test moves, and a bounded wait on a condition."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class Clock:
    """Stands in for the ``time`` module of the module under test (``monkeypatch.setattr(mod, "time",
    clock)``): wall time and monotonic time, both moved only by ``advance``."""

    def __init__(self, wall: float = 1_800_000_000.0, mono: float = 1_000.0) -> None:
        self.wall = wall
        self.mono = mono

    def time(self) -> float:
        return self.wall

    def monotonic(self) -> float:
        return self.mono

    def advance(self, seconds: float) -> None:
        self.wall += seconds
        self.mono += seconds

    def now_ms(self) -> int:
        return int(self.wall * 1000)


async def until(check: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait until ``check()`` holds, looking once per loop turn (the fakes answer within a few turns);
    fail after ``timeout`` seconds."""
    async with asyncio.timeout(timeout):
        while not check():  # noqa: ASYNC110 - the code under test sets no event: a loop turn is its step
            await asyncio.sleep(0)
