"""The I/O around bot scoring: record grab attempts (hubs), read the last minute of them, apply the
decisions as time-limited throttles and blocks that every hub enforces at grab time, list and lift
blocks."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import msgpack
from redis.exceptions import RedisError

from server import keys
from server.botscore import Attempt, Decision, Rules, score
from server.core import Core
from server.ledger import now_ms

log = logging.getLogger(__name__)


def _text(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


class AttemptLog:
    """Grab attempts as a hub records them for the detector: kept in memory and written as one stream
    entry (a msgpack list of attempts) per ``interval``, so a grab storm costs the stream one entry per
    interval, not one per grab. A hub that dies loses at most one interval of them: they only advise."""

    def __init__(self, core: Core, interval: float = 0.1) -> None:
        self.core = core
        self.interval = interval
        self.pending: list[list[object]] = []
        self.timer: asyncio.TimerHandle | None = None
        self.writing: set[asyncio.Task[None]] = set()

    def record(self, a: Attempt) -> None:
        self.pending.append([a.user, a.group, a.packet, a.reaction_ms, a.device, a.ms])
        if self.timer is None:
            self.timer = asyncio.get_running_loop().call_later(self.interval, self._write_soon)

    def _write_soon(self) -> None:
        task = asyncio.get_running_loop().create_task(self.flush())
        self.writing.add(task)
        task.add_done_callback(self.writing.discard)

    async def flush(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        batch, self.pending = self.pending, []
        if not batch:
            return
        try:
            await self.core.redis.xadd(
                keys.GRAB_ATTEMPTS, {"a": msgpack.packb(batch)}, maxlen=10_000, approximate=True
            )
        except RedisError as e:
            log.warning("%d grab attempts not recorded for the bot detector: %s", len(batch), e)

    async def close(self) -> None:
        await self.flush()
        if self.writing:
            await asyncio.gather(*self.writing, return_exceptions=True)


async def recent_attempts(core: Core, now: int, window_ms: int = 60_000) -> list[Attempt]:
    # An entry is written up to one interval after its attempts: read a little further back, then
    # keep the attempts of the window by their own time.
    rows = await core.redis.xrange(keys.GRAB_ATTEMPTS, min=str(now - window_ms - 5_000), max="+")
    out = []
    for _, f in rows:
        for user, group, packet, reaction_ms, device, ms in msgpack.unpackb(f[b"a"]):
            if ms >= now - window_ms:
                out.append(Attempt(user, group, packet, reaction_ms, device, ms))
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
