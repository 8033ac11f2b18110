"""The floor a grab's Redis CPU is measured against (issue 46): a minimal one-key script ``EVALSHA``'d in
pipelines as deep as the hub's grabs went (the hub's ``redpacket_redis_pipelined_calls_total`` over its
``redpacket_redis_pipelines_total`` in the grab phase), and what Redis spent per call."""

from __future__ import annotations

import re
import time
import urllib.request
from typing import Any

from server.store.redisnodes import RedisNodes

# Reads one key (which does not exist): the least a script that touches a key can do.
FLOOR_SCRIPT = "return redis.call('GET', KEYS[1])"


def pipelined(http_url: str) -> tuple[float, float]:
    """A hub's Redis pipelines so far and the calls in them, from its ``/metrics``."""
    with urllib.request.urlopen(f"{http_url}/metrics", timeout=10) as r:
        text = r.read().decode()

    def value(name: str) -> float:
        m = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
        if m is None:
            raise RuntimeError(f"the hub's /metrics has no {name}")
        return float(m[1])

    return value("redpacket_redis_pipelines_total"), value("redpacket_redis_pipelined_calls_total")


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
