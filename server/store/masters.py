"""Whether a Redis master keeps grabs as the settings ask: one judgement, read by the worker's gauges and
logs and by the operators' console."""

from __future__ import annotations

from server.durability import Durability
from server.store.batch import fsync_problem
from server.store.identities import eviction_problem
from server.store.redisnodes import MasterUsage


def durability_degraded(level: Durability, master: MasterUsage) -> str | None:
    """How this master keeps grabs less durable than ``level`` says, or None."""
    problem = fsync_problem(level, master.appendfsync)
    if problem is not None:
        return (
            f"{problem} (REDPACKET_GRAB_DURABILITY={level}: a replica promoted must fsync as its master did)"
        )
    if level.wants_replica and master.replicas == 0:
        if level.degrades:
            return "no replica could take its place: its grabs answered won are on its disk alone"
        return "no replica: its grabs fail until one is back"
    return None


def problem(level: Durability, master: MasterUsage) -> str | None:
    """Everything wrong with how this master keeps grabs (it may evict them; less durable than asked), or
    None."""
    found = (eviction_problem(master.eviction), durability_degraded(level, master))
    return "; ".join(p for p in found if p is not None) or None
