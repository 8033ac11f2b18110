"""The I/O around bot scoring: read the last minute of grab attempts, apply the decisions as
time-limited throttles and blocks that every hub enforces at grab time, list and lift blocks."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from server import keys
from server.botscore import Attempt, Decision, Rules, score
from server.core import Core
from server.ledger import now_ms

log = logging.getLogger(__name__)


def _text(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


async def recent_attempts(core: Core, now: int, window_ms: int = 60_000) -> list[Attempt]:
    rows = await core.redis.xrange(keys.GRAB_ATTEMPTS, min=str(now - window_ms), max="+")
    out = []
    for _, f in rows:
        d = {_text(k): _text(v) for k, v in f.items()}
        out.append(
            Attempt(
                user=int(d["user"]),
                group=int(d["group"]),
                packet=int(d["packet"]),
                reaction_ms=int(d["reaction_ms"]) if d.get("reaction_ms") else None,
                device=d.get("device", ""),
                ms=int(d["ms"]),
            )
        )
    return out


async def apply(core: Core, decisions: dict[int, Decision], rules: Rules, now: int) -> int:
    """Set the throttles and blocks; returns how many blocks were set."""
    blocks = 0
    for d in decisions.values():
        if d.action == "block":
            async with core.redis.pipeline(transaction=True) as pipe:
                pipe.set(keys.user_block(d.user), "; ".join(d.reasons), ex=d.seconds)
                pipe.zadd(keys.BLOCKS, {str(d.user): now + d.seconds * 1000})
                await pipe.execute()
            blocks += 1
            log.warning("blocked user %d for %d s: %s", d.user, d.seconds, "; ".join(d.reasons))
        else:
            await core.redis.set(keys.grab_throttle(d.user), rules.throttled_grabs_per_second, ex=d.seconds)
            log.info("throttled user %d for %d s: %s", d.user, d.seconds, "; ".join(d.reasons))
    return blocks


async def run_detector(core: Core, rules: Rules | None = None, now: int | None = None) -> dict[int, Decision]:
    rules = rules or Rules()
    now = now_ms() if now is None else now
    decisions = score(await recent_attempts(core, now), rules, now)
    await apply(core, decisions, rules, now)
    return decisions


@dataclass(frozen=True)
class Block:
    user: int
    until_ms: int
    reasons: str


async def list_blocks(core: Core) -> list[Block]:
    now = now_ms()
    await core.redis.zremrangebyscore(keys.BLOCKS, "-inf", now)
    out = []
    for user, until in await core.redis.zrange(keys.BLOCKS, 0, -1, withscores=True):
        reasons = await core.redis.get(keys.user_block(int(user)))
        if reasons is not None:
            out.append(Block(int(user), int(until), _text(reasons)))
    return out


async def lift(core: Core, user: int) -> bool:
    async with core.redis.pipeline(transaction=True) as pipe:
        pipe.delete(keys.user_block(user), keys.grab_throttle(user))
        pipe.zrem(keys.BLOCKS, str(user))
        deleted, _ = await pipe.execute()
    return bool(deleted)
