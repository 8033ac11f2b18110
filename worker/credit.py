"""The credit job: pay one grab into the grabber's balance.

Idempotent on the grab's unique keys: arq delivers at least once (a worker killed mid-job has the job
run again), and a second run credits nothing.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TypedDict

from arq import Retry

from server.core import Core
from server.crediting import credit_many
from server.db import Database, RetryableError
from server.errors import Conflict, NotFound
from server.ledger import Credit, credit_grab, now_ms
from worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)


class CreditBatcher:
    """Gathers the credit jobs running at the same moment into one transaction (``credit_many``).

    A lone credit waits ``linger`` seconds at most, so at low load a grab is paid at once; in a storm
    up to ``max_batch`` grabs share one commit. A job cancelled while waiting leaves its batch running;
    arq runs the job again and it finds the grab already credited.
    """

    def __init__(
        self, db: Database, metrics: WorkerMetrics | None = None, max_batch: int = 500, linger: float = 0.01
    ) -> None:
        self.db = db
        self.metrics = metrics or WorkerMetrics()
        self.max_batch = max_batch
        self.linger = linger
        self.pending: list[tuple[Credit, asyncio.Future[str]]] = []
        self.timer: asyncio.TimerHandle | None = None
        self.tasks: set[asyncio.Task[None]] = set()
        self.sizes: list[int] = []

    async def credit(self, c: Credit) -> str:
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.pending.append((c, fut))
        if len(self.pending) >= self.max_batch:
            self._flush()
        elif self.timer is None:
            self.timer = asyncio.get_running_loop().call_later(self.linger, self._flush)
        return await asyncio.shield(fut)

    def _flush(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        batch, self.pending = self.pending, []
        if batch:
            task = asyncio.create_task(self._run(batch))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _run(self, batch: list[tuple[Credit, asyncio.Future[str]]]) -> None:
        self.sizes.append(len(batch))
        try:
            outcomes = await credit_many(self.db, [c for c, _ in batch])
        except BaseException as e:
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(e if isinstance(e, Exception) else RuntimeError("batch cancelled"))
            raise
        self.metrics.batch_size.observe(len(batch))
        now = now_ms()
        for (c, fut), outcome in zip(batch, outcomes, strict=True):
            if outcome == "credited":
                self.metrics.credit_lag.observe(max(0, now - c.grabbed_ms) / 1000)
            if not fut.done():
                fut.set_result(outcome)


class Ctx(TypedDict, total=False):
    """What arq passes every job: our Core under "core", the worker's credit batcher, arq's own fields."""

    core: Core
    batcher: CreditBatcher
    metrics: WorkerMetrics
    job_try: int


async def credit_grab_job(
    ctx: Ctx, packet_id: int, user_id: int, seq: int, amount: int, grabbed_ms: int
) -> str:
    """Credit one grab (in a batch when the worker has a batcher). Cancelled half-way: the transaction
    rolls back, or commits for the whole batch; either way arq runs the job again and pays nothing twice."""
    core = ctx["core"]
    c = Credit(packet_id, user_id, seq, amount, grabbed_ms)
    batcher = ctx.get("batcher")
    try:
        if batcher is None:
            return await credit_grab(core.db, c)
        outcome = await batcher.credit(c)
        if outcome not in ("credited", "already"):
            log.error("credit of packet %d share %d refused: %s", packet_id, seq, outcome)
        return outcome
    except RetryableError as e:
        log.warning("credit of packet %d share %d will be retried: %s", packet_id, seq, e)
        raise Retry(defer=ctx.get("job_try", 1) * 0.5) from e
    except (Conflict, NotFound) as e:
        # Retrying cannot fix these; the reconciliation report shows them. Never pay on a guess.
        log.error("credit of packet %d share %d refused: %s %s", packet_id, seq, e.code, e.message)
        return e.code
