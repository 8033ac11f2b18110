"""Periodic jobs: refunds of expired packets, the sweeper of stranded grabs, reconciliation, bot scoring.

Each is idempotent; arq's ``unique`` cron runs each tick once across workers, and a second run (or two
workers racing) changes nothing more.
"""

from __future__ import annotations

import logging
from typing import Any

from server import settlement
from server.bots import run_detector
from server.reconcile import reconcile
from worker.credit import Ctx

log = logging.getLogger(__name__)


async def refund_expired_job(ctx: Ctx) -> dict[str, Any]:
    """Refund every packet past its expiry (and finish refunds a dead worker left half-way)."""
    core = ctx["core"]
    done: dict[str, int] = {}
    for packet_id in await settlement.due_for_refund(core):
        r = await settlement.refund_packet(core, packet_id)
        done[r.outcome] = done.get(r.outcome, 0) + 1
    done["finished"] = done.get("finished", 0) + await settlement.mark_finished(core)
    return done


async def sweep_job(ctx: Ctx) -> dict[str, int]:
    """Credit grabs that Redis holds and the database never received."""
    s = await settlement.sweep(ctx["core"])
    if s.credited_now:
        log.warning("sweeper credited %d stranded grab(s)", s.credited_now)
    return {"credited": s.credited_now, "refused": s.refused}


async def score_bots_job(ctx: Ctx) -> int:
    """Score the last minute of grab attempts; set throttles and blocks. Returns the blocks set."""
    decisions = await run_detector(ctx["core"])
    return sum(d.action == "block" for d in decisions.values())


async def reconcile_job(ctx: Ctx) -> int:
    """Log every difference in the books; returns how many there were."""
    report = await reconcile(ctx["core"].db)
    for d in report.differences:
        log.error("reconciliation: %s", d)
    return len(report.differences)
