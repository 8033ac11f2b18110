"""Periodic jobs: refunds of expired packets, announcements Redis missed, the sweeper of stranded grabs,
reconciliation, bot scoring.

Each is idempotent; arq's ``unique`` cron runs each tick once across workers, and a second run (or two
workers racing) changes nothing more.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Awaitable
from dataclasses import replace
from typing import Any, TypedDict, cast

from server.core import Core
from server.errors import Unavailable
from server.live import announce
from server.live.bots import run_detector
from server.money import payouts, settlement
from server.money.reconcilereport import Report, from_json, to_json
from server.settings import Settings, child_env
from server.stopping import child
from server.store import keys
from worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)


class Ctx(TypedDict, total=False):
    """What arq passes every job: our Core under "core", the worker's metrics, arq's own fields."""

    core: Core
    metrics: WorkerMetrics
    job_try: int


async def refund_expired_job(ctx: Ctx) -> dict[str, Any]:
    """Refund every packet past its expiry (and finish refunds a dead worker left half-way)."""
    core = ctx["core"]
    metrics = ctx.get("metrics")
    done: dict[str, int] = {}
    for packet_id in await settlement.due_for_refund(core):
        try:
            r = await settlement.refund_packet(core, packet_id)
        except Unavailable as e:
            # Redis or the database away: the packet stays refunding (closed to grabs) until a run gets
            # through; nothing is refunded on what the database alone says.
            log.warning("refund of packet %d waits: %s; the next run tries again", packet_id, e.message)
            if metrics:
                metrics.refund_failures.inc()
            continue
        except Exception:
            log.exception("refund of packet %d failed; the next run tries again", packet_id)
            if metrics:
                metrics.refund_failures.inc()
            continue
        done[r.outcome] = done.get(r.outcome, 0) + 1
        if metrics:
            metrics.refunds.labels(r.outcome).inc()
    done["finished"] = done.get("finished", 0) + await settlement.mark_finished(core)
    return done


async def expire_holds_job(ctx: Ctx) -> int:
    """Holds past their expiry back to their balances (a confirm after the expiry finds them expired
    anyway); a job of its own, so a refund that fails never holds them up."""
    return await payouts.expire_due(ctx["core"].db)


async def announce_job(ctx: Ctx) -> int:
    """Announce packets that were paid for and saved while Redis was unavailable (exactly once)."""
    return await announce.announce_pending(ctx["core"])


async def sweep_job(ctx: Ctx) -> dict[str, int]:
    """Credit grabs that Redis holds and the database never received."""
    core = ctx["core"]
    s = await settlement.sweep(core)
    if s.credited_now:
        if "metrics" in ctx:
            ctx["metrics"].swept.inc(s.credited_now)
        log.warning("sweeper credited %d stranded grab(s)", s.credited_now)
    return {"credited": s.credited_now, "refused": s.refused}


async def score_bots_job(ctx: Ctx) -> int:
    """Score the last minute of grab attempts; set throttles and blocks. Returns the blocks set."""
    decisions = await run_detector(ctx["core"])
    blocks = sum(d.action == "block" for d in decisions.values())
    if "metrics" in ctx:
        ctx["metrics"].blocks_set.inc(blocks)
    return blocks


async def reconcile_job(ctx: Ctx) -> int:
    """Log every difference in the books; returns how many there were."""
    report = await reconcile_in_child(ctx["core"].settings)
    at = time.time()
    # For every worker's metrics (each reads it in its heartbeat), not only this one's.
    shown = replace(report, differences=report.differences[:REPORT_DIFFERENCES])
    outcome = {"differences": len(report.differences), "at": at, "report": to_json(shown)}
    await cast(Awaitable[int], ctx["core"].redis.hset(keys.reconciled(), mapping=outcome))
    if "metrics" in ctx:
        ctx["metrics"].reconciled.record(len(report.differences), at)
    for d in report.differences:
        log.error("reconciliation: %s", d)
    return len(report.differences)


# The differences of the last reconciliation kept for the operators' console (all of them are logged).
REPORT_DIFFERENCES = 100

# The reconciliation's priority (``nice``): the credits come first; it takes the CPU they leave.
RECONCILE_NICE = 10


async def reconcile_in_child(settings: Settings) -> Report:
    """``redpacket reconcile --json`` on these settings, run as a child process at a lower priority, and its
    report. A big ledger's reconciliation is seconds of CPU: on a thread of the worker it shared the
    interpreter's lock with the loop that pays credits, and a 2,000 grabs/s storm's credit lag P99 was 259
    and 642 ms beside two of them, against 64 and 98 ms with them in a niced child (docs/benchmarks.md).
    No report (the child failed: the services away, a database behind the code, stopped): a
    ``ReconcileFailed`` naming its exit code and the end of what it said."""
    argv = [sys.executable, "-m", "server", "reconcile", "--json"]
    code, out, err = await child(argv, child_env(**settings.to_env()), "reconcile", nice=RECONCILE_NICE)
    said = err.decode(errors="replace").strip()[-2000:]
    if code not in (0, 1) or not out.strip():  # (1 is also "differences found", with the report)
        raise ReconcileFailed(f"`redpacket reconcile` exited {code} with no report: {said}")
    try:
        return from_json(out)
    except ValueError as e:
        raise ReconcileFailed(f"`redpacket reconcile` exited {code}: {e}; it said: {said}") from None


class ReconcileFailed(RuntimeError):
    """The worker's reconciliation made no report."""
