"""When a hub process collects its garbage: not in the middle of a storm.

With 10,000 sockets a hub holds a few million objects that live as long as their connections. A full
collection walks all of them — a quarter of a second with the event loop stopped — and the young
collections of a busy burst promote into that generation, so sooner or later one lands in a storm.
So a hub (``redpacket serve`` / ``up``) keeps what has survived in CPython's *permanent* generation
(``gc.freeze``), which no automatic collection walks: a storm's collections only see the storm's own
objects. Every ``every`` seconds it moves what survived since into that generation too (new connections;
an O(1) move), and checks the frames it received since: when the hub has been quiet
(fewer than ``quiet_frames_per_second``) and the last full collection is over ``full_after`` seconds
old — or in any case after ``full_at_most`` seconds — it unfreezes, collects everything (freeing what
closed connections left in reference cycles) and freezes again.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


async def keep_collections_out_of_bursts(
    frames_so_far: Callable[[], float],
    every: float = 5.0,
    quiet_frames_per_second: float = 100.0,
    full_after: float = 60.0,
    full_at_most: float = 600.0,
) -> None:
    """Run until cancelled (then the permanent generation is given back to the collector)."""
    gc.freeze()
    last_full = time.monotonic()
    seen = frames_so_far()
    try:
        while True:
            await asyncio.sleep(every)
            now, frames = time.monotonic(), frames_so_far()
            quiet = (frames - seen) / every < quiet_frames_per_second
            seen = frames
            if (quiet and now - last_full > full_after) or now - last_full > full_at_most:
                gc.unfreeze()
                found = gc.collect()
                gc.freeze()
                last_full = time.monotonic()
                log.debug("full collection: %d unreachable, %.0f ms", found, (last_full - now) * 1000)
            else:
                gc.freeze()  # what survived since the last tick (new connections) joins the rest: O(1)
    finally:
        gc.unfreeze()
