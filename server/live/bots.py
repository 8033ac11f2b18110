"""The I/O around bot scoring: record grab attempts (hubs), read the last minute of them, apply the
decisions as time-limited throttles and blocks that every hub enforces at grab time, list and lift
blocks."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import cast

import msgpack

from server.core import Core
from server.ids import GroupId, PacketId, UserId
from server.live.botscore import WINDOW_MS, Attempt, Decision, Rules, score
from server.money.ledger import now_ms
from server.store import keys

log = logging.getLogger(__name__)


def _text(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


# Grab attempts kept while Redis cannot take them: only those the detector still reads (its window), and
# at most this many of them (~10 MB; the oldest go first).
KEEP_AT_MOST = 50_000
# After the n-th failed write in a row the next is tried RETRY_AFTER[n - 1] later (the last from then on).
RETRY_AFTER = (0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


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
        self.flushing = False  # a write is in flight: the next is armed when it ends
        self.failures = 0  # writes failed in a row
        self.pause = interval  # before the write armed last
        self.closed = False

    def record(self, a: Attempt) -> None:
        self.pending.append([a.user, a.group, a.packet, a.reaction_ms, a.device, a.ms])
        self._arm()

    def _arm(self) -> None:
        if self.timer is None and not self.closed and not self.flushing:
            failed = min(self.failures, len(RETRY_AFTER))
            self.pause = RETRY_AFTER[failed - 1] if failed else self.interval
            self.timer = asyncio.get_running_loop().call_later(self.pause, self._write_soon)

    def _write_soon(self) -> None:
        self.timer = None
        task = asyncio.get_running_loop().create_task(self.flush())
        self.writing.add(task)
        task.add_done_callback(self.writing.discard)

    async def flush(self) -> None:
        """Write what is pending as one entry. If Redis fails (away, failing over — or redis-py's cluster
        client tripping over itself meanwhile), the attempts the detector still reads are kept (up to
        ``KEEP_AT_MOST``) and written with a later entry, tried again after a growing pause."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        batch, self.pending = self.pending, []
        if not batch:
            return
        self.flushing = True
        failed: Exception | None = None
        try:
            await self.core.redis.xadd(
                keys.grab_attempts(), {"a": msgpack.packb(batch)}, maxlen=10_000, approximate=True
            )
        except Exception as e:  # never lost to a transient error, never a task that dies
            failed = e
        finally:
            self.flushing = False
        if failed is None:
            self.failures = 0
        else:
            since = now_ms() - WINDOW_MS
            kept = [a for a in batch + self.pending if cast(int, a[5]) >= since]
            self.pending = kept[-KEEP_AT_MOST:]
            self.failures += 1
            if self.failures == 1 or self.failures % 10 == 0:
                log.warning(
                    "%d grab attempts kept for the bot detector, written later (%d failed writes): %s",
                    len(self.pending),
                    self.failures,
                    failed,
                )
        if self.pending:
            self._arm()

    async def close(self) -> None:
        """Write what is pending (once: if Redis is away, it is lost with the hub) and record no more."""
        self.closed = True
        await self.flush()
        if self.writing:
            await asyncio.gather(*self.writing, return_exceptions=True)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


async def recent_attempts(core: Core, now: int, window_ms: int = WINDOW_MS) -> list[Attempt]:
    # An entry is written up to one interval after its attempts: read a little further back, then
    # keep the attempts of the window by their own time.
    rows = await core.redis.xrange(keys.grab_attempts(), min=str(now - window_ms - 5_000), max="+")
    out = []
    for _, f in rows:
        for user, group, packet, reaction_ms, device, ms in msgpack.unpackb(f[b"a"]):
            if ms >= now - window_ms:
                out.append(
                    Attempt(
                        user=UserId(user),
                        group=GroupId(group),
                        packet=PacketId(packet),
                        reaction_ms=reaction_ms,
                        device=device,
                        ms=ms,
                    )
                )
    return out


async def apply(core: Core, decisions: dict[int, Decision], rules: Rules, now: int) -> int:
    """Set the throttles and blocks; returns how many blocks were set.

    The grab script reads them in its own slot, so each decision is written into every shard's gate
    (``keys.shard_gate``); blocks are also listed for operators under ``{ctl}``. Entries past their end are
    removed here too. Blocks are rare: a few dozen writes per decision is cheap.
    """
    blocks = 0
    async with core.redis.pipeline(transaction=False) as pipe:
        for d in decisions.values():
            until = now + d.seconds * 1000
            for n in range(keys.SHARDS):
                if d.action == "block":
                    pipe.hset(keys.shard_gate(n), f"b:{d.user}", str(until))
                else:
                    slower = f"{rules.throttled_grabs_per_second}:{until}"
                    pipe.hset(keys.shard_gate(n), f"t:{d.user}", slower)
            if d.action == "block":  # it outranks the user's throttle, which goes (listed once)
                pipe.zadd(keys.blocks(), {str(d.user): until})
                pipe.hset(keys.block_reasons(), str(d.user), "; ".join(d.reasons))
                pipe.zrem(keys.throttles(), str(d.user))
                pipe.hdel(keys.block_reasons(), f"t:{d.user}")
                for n in range(keys.SHARDS):
                    pipe.hdel(keys.shard_gate(n), f"t:{d.user}")
            else:
                pipe.zadd(keys.throttles(), {str(d.user): until})
                pipe.hset(keys.block_reasons(), f"t:{d.user}", "; ".join(d.reasons))
        await pipe.execute()
    for d in decisions.values():
        if d.action == "block":
            blocks += 1
            log.warning("blocked user %d for %d s: %s", d.user, d.seconds, "; ".join(d.reasons))
        else:
            log.info("throttled user %d for %d s: %s", d.user, d.seconds, "; ".join(d.reasons))
    await _forget_expired(core, now)
    return blocks


async def _forget_expired(core: Core, now: int) -> None:
    """Drop gate entries whose time is over (they no longer apply; this keeps the gates small)."""
    async with core.redis.pipeline(transaction=False) as pipe:
        for n in range(keys.SHARDS):
            pipe.hgetall(keys.shard_gate(n))
        gates = await pipe.execute()
    async with core.redis.pipeline(transaction=False) as pipe:
        for n, gate in enumerate(gates):
            over = [field for field, value in gate.items() if int(_text(value).rsplit(":", 1)[-1]) <= now]
            if over:
                pipe.hdel(keys.shard_gate(n), *over)
        expired = await core.redis.zrangebyscore(keys.blocks(), "-inf", now)
        if expired:
            pipe.zrem(keys.blocks(), *expired)
            pipe.hdel(keys.block_reasons(), *expired)
        slowed = await core.redis.zrangebyscore(keys.throttles(), "-inf", now)
        if slowed:
            pipe.zrem(keys.throttles(), *slowed)
            pipe.hdel(keys.block_reasons(), *(f"t:{_text(u)}" for u in slowed))
        forgiven = await cast(Awaitable[dict[bytes, bytes]], core.redis.hgetall(keys.forgiven()))
        past = [_text(u) for u, ms in forgiven.items() if int(ms) < now - WINDOW_MS]  # none of then is read
        if past:
            pipe.hdel(keys.forgiven(), *past)
        await pipe.execute()


async def run_detector(core: Core, rules: Rules | None = None, now: int | None = None) -> dict[int, Decision]:
    """Score the last minute's grab attempts and apply what is new: a user already under a throttle (or a
    block) is not throttled again by the attempts that throttled them — the detector runs every 10 s over
    a minute, so each attempt is read six times — only a block outranks a throttle; attempts made before
    an operator lifted a user's decision are not scored again. The decisions applied."""
    rules = rules or Rules(exempt=core.settings.bot_exempt_user_ids)
    now = now_ms() if now is None else now
    async with core.redis.pipeline(transaction=False) as pipe:
        pipe.hgetall(keys.forgiven())
        pipe.hgetall(keys.shard_gate(0))  # every shard holds the same decisions
        forgiven_raw, gate = await pipe.execute()
    forgiven = {int(u): int(ms) for u, ms in forgiven_raw.items()}
    attempts = [a for a in await recent_attempts(core, now) if a.ms > forgiven.get(a.user, -1)]
    active: dict[tuple[str, int], int] = {}
    for field, value in gate.items():
        kind, _, user = _text(field).partition(":")
        active[(kind, int(user))] = int(_text(value).rsplit(":", 1)[-1])
    decisions = {
        user: d
        for user, d in score(attempts, rules, now).items()
        if active.get(("b", user), 0) <= now and (d.action == "block" or active.get(("t", user), 0) <= now)
    }
    await apply(core, decisions, rules, now)
    return decisions


@dataclass(frozen=True)
class Block:
    user: int
    until_ms: int
    reasons: str
    action: str = "block"  # or "throttle"


async def list_blocks(core: Core) -> list[Block]:
    """The blocks and throttles in force, blocks first."""
    now = now_ms()
    out = []
    for action, listed, prefix in (("block", keys.blocks(), ""), ("throttle", keys.throttles(), "t:")):
        for user, until in await core.redis.zrangebyscore(listed, f"({now}", "+inf", withscores=True):
            field = f"{prefix}{_text(user)}"
            reasons = await cast(Awaitable[bytes | None], core.redis.hget(keys.block_reasons(), field))
            out.append(Block(int(user), int(until), _text(reasons or b""), action))
    return out


async def lift(core: Core, user: int) -> bool:
    """End a user's block and throttle on every shard, and forgive the attempts that led to them (the
    detector does not score them again); True if they were blocked or throttled."""
    async with core.redis.pipeline(transaction=False) as pipe:
        for n in range(keys.SHARDS):
            pipe.hdel(keys.shard_gate(n), f"b:{user}", f"t:{user}")
        pipe.zrem(keys.blocks(), str(user))
        pipe.zrem(keys.throttles(), str(user))
        pipe.hdel(keys.block_reasons(), str(user), f"t:{user}")
        pipe.hset(keys.forgiven(), str(user), str(now_ms()))
        results = await pipe.execute()
    return any(results[: keys.SHARDS + 2])
