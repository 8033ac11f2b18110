"""The hub's garbage-collection policy: full collections only when quiet (``server.hub.gcpolicy``)."""

from __future__ import annotations

import asyncio
import gc
import weakref

from server.hub.gcpolicy import keep_collections_out_of_bursts
from tests.hubtools import eventually


class _Cycle:
    def __init__(self) -> None:
        self.me = self


async def test_a_quiet_hub_collects_everything_and_freezes_again() -> None:
    keeper = asyncio.create_task(keep_collections_out_of_bursts(lambda: 0.0, every=0.01, full_after=0.0))
    cycle = _Cycle()
    ref = weakref.ref(cycle)
    await eventually(lambda: gc.get_freeze_count() > 0)
    del cycle
    try:
        await eventually(lambda: ref() is None)
        await eventually(lambda: gc.get_freeze_count() > 0)
    finally:
        keeper.cancel()
        await asyncio.gather(keeper, return_exceptions=True)
    assert gc.get_freeze_count() == 0


async def test_a_busy_hub_waits_for_quiet_until_the_bound() -> None:
    calls = []

    def busy() -> float:
        calls.append(1)
        return float(len(calls) * 1_000_000)  # a million frames a tick

    keeper = asyncio.create_task(
        keep_collections_out_of_bursts(busy, every=0.01, full_after=0.0, full_at_most=3600)
    )
    cycle = _Cycle()
    ref = weakref.ref(cycle)
    await eventually(lambda: gc.get_freeze_count() > 0)
    del cycle
    try:
        await eventually(lambda: len(calls) >= 20)
        gc.collect()  # an ordinary collection does not walk the permanent generation
        assert ref() is not None  # and twenty busy ticks brought no full one
    finally:
        keeper.cancel()
        await asyncio.gather(keeper, return_exceptions=True)
    gc.collect()
    assert ref() is None
