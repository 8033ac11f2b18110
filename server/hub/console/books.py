"""What the console shows of the books and of what keeps them: the last reconciliation (when, what it
found, per shard), the credit outboxes' backlog per shard, the hubs and workers seen, each Redis master
with the durability in force and what is wrong with it, the database writer and a sharded ledger's
backends. Each part is read within ``PART_SECONDS``; a part that fails or hangs says so, the rest shows."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any, cast

from server.core import Core
from server.live import seen
from server.money import casefiles
from server.money.ledger import now_ms
from server.store import keys, masters
from server.store.backlog import backlog

PART_SECONDS = 3.0


async def books(core: Core) -> dict[str, Any]:
    now = now_ms()
    parts: dict[str, Callable[[], Awaitable[Any]]] = {
        "reconciliation": lambda: _reconciliation(core),
        "outbox": lambda: outbox(core),
        "processes": lambda: seen.listing(core, now),
        "redis": lambda: _masters(core),
        "database": lambda: _database(core),
    }
    answers = await asyncio.gather(*(_bounded(read()) for read in parts.values()))
    return {
        "now_ms": now,
        "durability": str(core.settings.durability),
        **dict(zip(parts, answers, strict=True)),
    }


async def _bounded(aw: Awaitable[Any]) -> Any:
    try:
        async with asyncio.timeout(PART_SECONDS):
            return await aw
    except TimeoutError:
        return {"error": f"no answer within {PART_SECONDS:g} s"}
    except Exception as e:  # (a service away: said in its part, the others still shown)
        return {"error": f"{type(e).__name__}: {e}"[:300]}


async def _reconciliation(core: Core) -> dict[str, Any] | None:
    last = await cast(Awaitable[dict[bytes, bytes]], core.redis.hgetall(keys.reconciled()))
    if b"at" not in last:
        return None  # no worker has reconciled since Redis started
    report = json.loads(last[b"report"]) if b"report" in last else None
    return {
        "at_ms": int(float(last[b"at"]) * 1000),
        "differences": int(last[b"differences"]),
        "report": report,
    }


async def outbox(core: Core) -> dict[str, Any]:
    """The credits in the shards' outboxes (waiting for a worker, or being paid) and the oldest one's age."""
    waiting = await backlog(core.redis)
    oldest = waiting.oldest_ms
    return {
        "total": waiting.total,
        "shards": keys.SHARDS,
        "oldest_ms": oldest,
        "lag_ms": None if oldest is None else max(0, now_ms() - oldest),
        "waiting": [{"shard": n, "entries": d} for n, d in enumerate(waiting.depths) if d],
    }


async def _masters(core: Core) -> list[dict[str, Any]]:
    level = core.settings.durability
    return [
        {
            "address": address,
            "replicas": m.replicas,
            "appendfsync": m.appendfsync,
            "maxmemory_policy": m.eviction,
            "memory_bytes": m.memory,
            "problem": masters.problem(level, m),
        }
        for address, m in sorted((await core.nodes.usage()).items())
    ]


async def _database(core: Core) -> dict[str, Any]:
    db = core.db
    out: dict[str, Any] = {"dialect": db.dialect.name, "shards": db.shards, "writer": None, "backends": []}
    if db.dialect.name != "mysql":
        return out
    out["writer"] = getattr(db, "writer", None)
    out["writer_recorded"] = await casefiles.writer_recorded(db)
    out["backends"] = await casefiles.backends(db) if db.shards else []
    return out
