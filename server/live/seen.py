"""Which hubs and workers are running: each process says so in Redis every few seconds (``beat``, its own
field of ``keys.seen()``), and the operators' console lists them (``listing``). A process gone for more
than ``FORGET_MS`` is forgotten by the next beat of any other."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Awaitable
from typing import Any, Literal, cast

from server.core import Core
from server.money.ledger import now_ms
from server.store import keys

Role = Literal["hub", "worker"]
BEAT_SECONDS = 5.0
FORGET_MS = 3_600_000


def field(role: Role, id: str) -> str:
    return f"{role}:{id}"


async def beat(core: Core, role: Role, id: str, **said: Any) -> None:
    """This process is alive now (with what it says of itself: ``said``); the long-gone are forgotten."""
    now = now_ms()
    me = {"role": role, "id": id, "host": socket.gethostname(), "pid": os.getpid(), "seen_ms": now, **said}
    await cast(Awaitable[int], core.redis.hset(keys.seen(), field(role, id), json.dumps(me)))
    stale = [f for f, s in (await _said(core)).items() if now - int(s.get("seen_ms", 0)) > FORGET_MS]
    if stale:
        await cast(Awaitable[int], core.redis.hdel(keys.seen(), *stale))


async def listing(core: Core, now: int) -> list[dict[str, Any]]:
    """Every process seen, the latest first, each with ``ago_ms``."""
    out = [{**s, "ago_ms": now - int(s.get("seen_ms", 0))} for s in (await _said(core)).values()]
    return sorted(out, key=lambda s: s["ago_ms"])


async def _said(core: Core) -> dict[str, dict[str, Any]]:
    """Field → what that process said of itself (an entry that is not JSON: an empty one)."""
    found = await cast(Awaitable[dict[bytes, bytes]], core.redis.hgetall(keys.seen()))
    out: dict[str, dict[str, Any]] = {}
    for f, v in found.items():
        try:
            said = json.loads(v)
        except ValueError:
            said = {}
        out[f.decode(errors="replace")] = said if isinstance(said, dict) else {}
    return out
