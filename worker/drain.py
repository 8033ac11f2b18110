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
import logging
from typing import Any

from arq.constants import in_progress_key_prefix, job_key_prefix, result_key_prefix
from arq.jobs import deserialize_job, serialize_result

from server.core import Core
from server.crediting import credit_many
from server.ledger import Credit, now_ms
from server.queue import CREDIT_GRAB, job_deserializer, job_serializer
from worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)

CLAIM_MS = 60_000
KEEP_RESULT_MS = 24 * 3600 * 1000


class CreditDrain:
    def __init__(self, core: Core, metrics: WorkerMetrics | None = None, batch: int = 500) -> None:
        self.core = core
        self.metrics = metrics or WorkerMetrics()
        self.batch = batch
        self.credited = 0

    async def once(self) -> int:
        """Take up to ``batch`` due credit jobs and finish them; returns how many were taken."""
        redis, queue = self.core.redis, self.core.settings.queue_name
        due = await redis.zrangebyscore(queue, "-inf", now_ms(), start=0, num=self.batch * 2)
        ids = [i for i in due if i.startswith(b"credit:")][: self.batch]
        if not ids:
            return 0
        scripts = self.core.scripts
        got = await scripts.claim_jobs(
            args=[in_progress_key_prefix, job_key_prefix, CLAIM_MS, *[i.decode() for i in ids]]
        )
        mine = [got[i].decode() for i in range(0, len(got), 2)]
        payloads = [got[i] for i in range(1, len(got), 2)]
        if not mine:
            return 0
        jobs: list[tuple[str, Any, Credit]] = []
        for job_id, payload in zip(mine, payloads, strict=True):
            if not payload:  # expired before anyone ran it: finished below, and the sweeper pays its grab
                continue
            job = deserialize_job(payload, deserializer=job_deserializer)
            packet_id, user_id, seq, amount, grabbed_ms = job.args
            jobs.append((job_id, job, Credit(packet_id, user_id, seq, amount, grabbed_ms)))
        started = now_ms()
        try:
            outcomes = await credit_many(self.core.db, [c for _, _, c in jobs]) if jobs else []
        except Exception:
            # Nothing was committed: let the jobs go back to whoever takes them next.
            await redis.delete(*[in_progress_key_prefix + j for j in mine])  # give them back
            raise
        finished = now_ms()
        self.metrics.batch_size.observe(len(jobs))
        results: dict[str, bytes] = {}
        for (job_id, job, c), outcome in zip(jobs, outcomes, strict=True):
            if outcome == "credited":
                self.credited += 1
                self.metrics.credit_lag.observe(max(0, finished - c.grabbed_ms) / 1000)
            elif outcome != "already":
                log.error("credit of packet %d share %d refused: %s", c.packet_id, c.seq, outcome)
            # The same result arq would keep: while it exists, enqueueing this grab again is a no-op.
            enqueued = int(job.enqueue_time.timestamp() * 1000)
            result = serialize_result(
                CREDIT_GRAB, job.args, job.kwargs, job.job_try or 1, enqueued,
                True, outcome, started, finished, job_id, queue, job_id, serializer=job_serializer,
            )  # fmt: skip
            results[job_id] = result or b""
        pairs: list[str | bytes] = []
        for job_id in mine:
            pairs += [job_id, results.get(job_id, b"")]
        await scripts.finish_jobs(
            keys=[queue],
            args=[in_progress_key_prefix, job_key_prefix, result_key_prefix, KEEP_RESULT_MS, *pairs],
        )
        return len(mine)

    async def run(self, idle_sleep: float = 0.05) -> None:
        """Drain until cancelled. Cancelled mid-batch: its claims expire and the jobs run again."""
        while True:
            try:
                taken = await self.once()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("credit drain failed; retrying")
                taken = 0
                await asyncio.sleep(1)
            if not taken:
                await asyncio.sleep(idle_sleep)

    async def until_empty(self) -> int:
        """Drain until no credit job is due (tests, benchmarks); returns how many were credited."""
        while await self.once():
            pass
        return self.credited
