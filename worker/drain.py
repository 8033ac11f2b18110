"""The credit drain: every worker's way of paying grabs. It takes hundreds of queued credits at a time,
pays them in one transaction per batch (``credit_many``, exactly once by the database's unique keys),
then marks them done.

The queue is the drain's own (``keys.credit_queue``; ``lua/grab.lua`` queues each credit in the grab's own
call). A worker *claims* a batch for a short lease (``LEASE_MS``) and renews its leases every
``LEASE_MS / 4`` while it holds them, so a worker that dies — kill -9, a lost machine — leaves claims that
lapse within seconds; the next claim by any worker puts them back at the head of the queue and pays
them. A worker that only stalled past its lease may pay a batch another worker also pays: the database
credits each share once, so that is only wasted work.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from dataclasses import dataclass

from server import keys
from server.core import Core
from server.crediting import credit_many
from server.ledger import Credit, now_ms
from worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)

LEASE_MS = 5_000


@dataclass
class Batch:
    """Credits claimed together: their queue entries, and the credits they name."""

    entries: list[str]
    credits: list[Credit]


class CreditDrain:
    """Takes ``batch`` credits at a time. While one batch is paid in the database the next one is claimed
    from Redis and the previous one marked done, so Redis and database work overlap."""

    def __init__(
        self, core: Core, metrics: WorkerMetrics | None = None, batch: int = 500, lease_ms: int = LEASE_MS
    ) -> None:
        self.core = core
        self.metrics = metrics or WorkerMetrics()
        self.batch = batch
        self.lease_ms = lease_ms
        queue = core.settings.queue_name
        self.queue, self.claims = keys.credit_queue(queue), keys.credit_claims(queue)
        self.holding: set[str] = set()  # entries this drain has claimed and not yet finished or released
        self.credited = 0  # shares newly credited
        self.processed = 0  # queue entries finished (credited, already paid, or refused)

    async def run(self, idle_sleep: float = 0.05) -> None:
        """Drain until cancelled, riding out Redis and database outages (retrying with back-off).
        Cancelled mid-batch: its claims are given back (or lapse) and the credits are paid later; the
        database pays nothing twice."""
        failures = 0
        while True:
            try:
                await self._drain()
                if failures:
                    log.warning("credit drain working again after %d failed attempt(s)", failures)
                failures = 0
                await asyncio.sleep(idle_sleep)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                failures += 1
                if failures == 1:
                    log.warning("credit drain failed (%s); retrying with back-off", e)
                await asyncio.sleep(min(0.1 * 2**failures, 2.0))

    async def until_empty(self) -> int:
        """Drain until no credit is due (tests, benchmarks); returns how many were newly credited."""
        await self._drain()
        return self.credited

    async def _drain(self) -> None:
        """Claim, pay and finish batches until nothing is due."""
        renewing = asyncio.ensure_future(self._renew_leases())
        claiming: asyncio.Future[Batch | None] = asyncio.ensure_future(self._claim())
        finishing: asyncio.Future[None] | None = None
        paid = False
        try:
            while True:
                taken = await claiming
                if taken is None and paid:
                    # That claim ran while the last batch was being paid: look again for what came since.
                    taken = await self._claim()
                if taken is None:
                    return
                claiming = asyncio.ensure_future(self._claim())  # the next batch, while this one pays
                outcomes = await self._pay(taken)
                paid = True
                if finishing is not None:
                    await finishing
                finishing = asyncio.ensure_future(self._finish(taken, outcomes))
        finally:
            if finishing is not None:
                await asyncio.shield(finishing)
            if not claiming.done():
                claiming.cancel()
            with contextlib.suppress(BaseException):
                unpaid = await claiming
                if unpaid is not None:
                    await self._release(unpaid)
            renewing.cancel()
            with contextlib.suppress(BaseException):
                await renewing

    async def _renew_leases(self) -> None:
        while True:
            await asyncio.sleep(self.lease_ms / 4000)
            held = list(self.holding)
            if held:
                until = now_ms() + self.lease_ms
                with contextlib.suppress(Exception):  # a lapsed lease only costs a second payment attempt
                    await self.core.redis.zadd(self.claims, dict.fromkeys(held, until), xx=True)

    async def _claim(self) -> Batch | None:
        got = await self.core.scripts.claim_credits(
            keys=[self.queue, self.claims], args=[now_ms(), self.lease_ms, self.batch]
        )
        if not got:
            return None
        entries = [e.decode() if isinstance(e, bytes) else str(e) for e in got]
        self.holding.update(entries)
        return Batch(entries, [Credit(*keys.parse_credit_entry(e)) for e in entries])

    async def _pay(self, taken: Batch) -> list[str]:
        try:
            return await credit_many(self.core.db, taken.credits)
        except BaseException:
            # Nothing was committed: give the claims back for whoever takes them next.
            with contextlib.suppress(Exception):
                await self._release(taken)
            raise

    async def _release(self, taken: Batch) -> None:
        async with self.core.redis.pipeline(transaction=True) as pipe:
            pipe.zrem(self.claims, *taken.entries)
            pipe.zadd(self.queue, dict.fromkeys(taken.entries, 0))
            await pipe.execute()
        self.holding.difference_update(taken.entries)

    async def _finish(self, taken: Batch, outcomes: list[str]) -> None:
        finished = now_ms()
        self.metrics.batch_size.observe(len(taken.credits))
        paid: dict[int, list[int]] = defaultdict(list)
        for c, outcome in zip(taken.credits, outcomes, strict=True):
            if outcome == "credited":
                self.credited += 1
                self.metrics.credit_lag.observe(max(0, finished - c.grabbed_ms) / 1000)
            elif outcome != "already":
                # Retrying cannot fix a refusal; the reconciliation report shows it. Never pay on a guess.
                log.error("credit of packet %d share %d refused: %s", c.packet_id, c.seq, outcome)
                continue
            paid[c.packet_id].append(c.seq)
        s = self.core.settings
        async with self.core.redis.pipeline(transaction=False) as pipe:
            pipe.zrem(self.claims, *taken.entries)
            for packet_id, seqs in paid.items():
                pipe.sadd(keys.packet_paid(packet_id), *seqs)
                pipe.expire(keys.packet_paid(packet_id), s.packet_ttl_seconds + s.redis_grace_seconds)
            await pipe.execute()
        self.holding.difference_update(taken.entries)
        self.processed += len(taken.entries)
