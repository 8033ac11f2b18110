"""The bulk path for credits: take hundreds of queued credit jobs at a time, pay them in one
transaction each batch, and finish them as arq would.

arq starts each job with several sequential Redis round trips (~1,000 jobs/s here), which caps a worker
far below what one batched transaction can credit. The drain claims jobs the same way arq does (the
job's in-progress key, set only if absent, with a TTL), so it and arq's own loop never run one job
twice at once; a drain that dies mid-batch leaves claims that expire, and the jobs run again — the
database's unique keys make that a no-op. Jobs it does not take still run through arq, one by one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

from arq.jobs import serialize_result

from server import keys
from server.core import Core
from server.crediting import credit_many
from server.ledger import Credit, now_ms
from server.queue import CREDIT_GRAB, job_deserializer, job_serializer
from worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)

CLAIM_MS = 60_000
KEEP_RESULT_MS = 24 * 3600 * 1000


@dataclass
class Batch:
    """Jobs claimed together: every claimed id, and the credits of those whose payload still existed."""

    ids: list[str]
    jobs: list[tuple[str, dict[str, Any], Credit]]
    paying_from_ms: int = 0


class CreditDrain:
    """Takes ``batch`` jobs at a time. While one batch is paid in the database the next one is claimed
    from Redis and the previous one finished, so Redis and database work overlap."""

    def __init__(self, core: Core, metrics: WorkerMetrics | None = None, batch: int = 500) -> None:
        self.core = core
        self.metrics = metrics or WorkerMetrics()
        self.batch = batch
        self.credited = 0

    async def run(self, idle_sleep: float = 0.05) -> None:
        """Drain until cancelled. Cancelled mid-batch: its claims are given back (or expire) and the
        jobs run again; the database pays nothing twice."""
        while True:
            try:
                await self._drain()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("credit drain failed; retrying")
                await asyncio.sleep(1)
            await asyncio.sleep(idle_sleep)

    async def until_empty(self) -> int:
        """Drain until no credit job is due (tests, benchmarks); returns how many were credited."""
        await self._drain()
        return self.credited

    async def _drain(self) -> None:
        """Claim, pay and finish batches until nothing is due."""
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

    async def _claim(self) -> Batch | None:
        queue = self.core.settings.queue_name
        # Steps over at most 8 batches' worth of jobs that other workers hold before giving up for now.
        got = await self.core.scripts.claim_jobs(
            keys=[queue],
            args=[
                keys.IN_PROGRESS_KEY_PREFIX,
                keys.JOB_KEY_PREFIX,
                CLAIM_MS,
                now_ms(),
                self.batch,
                keys.CREDIT_JOB_ID_PREFIX,
                self.batch * 8,
            ],
        )
        if not got:
            return None
        ids = [got[i].decode() for i in range(0, len(got), 2)]
        jobs = []
        for job_id, payload in zip(ids, got[1::2], strict=True):
            if not payload:  # expired before anyone ran it: finished below, and the sweeper pays its grab
                continue
            job = job_deserializer(payload)  # arq's job map {t, f, a, k, et}
            packet_id, user_id, seq, amount, grabbed_ms = job["a"]
            jobs.append((job_id, job, Credit(packet_id, user_id, seq, amount, grabbed_ms)))
        return Batch(ids, jobs)

    async def _pay(self, taken: Batch) -> list[str]:
        taken.paying_from_ms = now_ms()
        try:
            return await credit_many(self.core.db, [c for _, _, c in taken.jobs]) if taken.jobs else []
        except BaseException:
            # Nothing was committed: let the jobs go back to whoever takes them next.
            with contextlib.suppress(Exception):
                await self._release(taken)
            raise

    async def _release(self, taken: Batch) -> None:
        await self.core.redis.delete(*[keys.IN_PROGRESS_KEY_PREFIX + j for j in taken.ids])

    async def _finish(self, taken: Batch, outcomes: list[str]) -> None:
        queue = self.core.settings.queue_name
        finished = now_ms()
        self.metrics.batch_size.observe(len(taken.jobs))
        results: dict[str, bytes] = {}
        for (job_id, job, c), outcome in zip(taken.jobs, outcomes, strict=True):
            if outcome == "credited":
                self.credited += 1
                self.metrics.credit_lag.observe(max(0, finished - c.grabbed_ms) / 1000)
            elif outcome != "already":
                log.error("credit of packet %d share %d refused: %s", c.packet_id, c.seq, outcome)
            # The same result arq would keep: while it exists, enqueueing this grab again is a no-op.
            result = serialize_result(
                CREDIT_GRAB, tuple(job["a"]), job["k"], job.get("t") or 1, job["et"], True, outcome,
                taken.paying_from_ms, finished, job_id, queue, job_id, serializer=job_serializer,
            )  # fmt: skip
            results[job_id] = result or b""
        pairs: list[str | bytes] = []
        for job_id in taken.ids:
            pairs += [job_id, results.get(job_id, b"")]
        await self.core.scripts.finish_jobs(
            keys=[queue],
            args=[
                keys.IN_PROGRESS_KEY_PREFIX,
                keys.JOB_KEY_PREFIX,
                keys.RESULT_KEY_PREFIX,
                KEEP_RESULT_MS,
                *pairs,
            ],
        )
