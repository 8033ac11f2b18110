"""The floor a grab's Redis CPU is measured against (issue 46): a minimal one-key script ``EVALSHA``'d in
pipelines as deep as the hub's grabs went (``bench.hubmetrics.pipelined``, read around the grab phase), and
what Redis spent per call."""

from __future__ import annotations

import time
from typing import Any

from server.store.redisnodes import RedisNodes

# Reads one key (which does not exist): the least a script that touches a key can do.
FLOOR_SCRIPT = "return redis.call('GET', KEYS[1])"


async def redis_floor(redis_url: str, depth: int, seconds: float) -> dict[str, Any]:
    """Pipelines of ``depth`` calls of the floor script, one after another, for ``seconds``: Redis's CPU
    per call (``INFO cpu``, every master)."""
    nodes = await RedisNodes(redis_url, 2).open()
    try:
        script = nodes.client.register_script(FLOOR_SCRIPT)
        keys = [f"redpacket:bench:floor:{i}" for i in range(depth)]
        await script(keys=keys[:1])  # loaded before the clock starts
        calls = 0
        before = sum((await nodes.cpu_seconds()).values())
        until = time.perf_counter() + seconds
        while time.perf_counter() < until:
            async with nodes.client.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.evalsha(script.sha, 1, key)
                await pipe.execute()
            calls += depth
        used = sum((await nodes.cpu_seconds()).values()) - before
    finally:
        await nodes.aclose()
    return {"redis_floor_depth": depth, "redis_floor_cpu_us_per_call": round(used * 1e6 / calls, 1)}
