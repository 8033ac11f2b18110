"""What ``redpacket bench hot``'s packet did to the books (``bench.hotbench``): what Redis says was handed
out, against the shares the database drew; then a ``redpacket worker`` credits it, and a reconciliation
reads the books."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, cast

from bench import creditbench
from bench.progress import phase
from launchers.throwaway import free_port
from server.core import open_core
from server.ids import GroupId, PacketId, UserId
from server.money import grabs
from server.money.reconcile import reconcile
from server.settings import Settings
from server.store import keys


async def paid(
    settings: Settings, db_url: str, *, packet_id: PacketId, group: GroupId, admin: UserId
) -> dict[str, Any]:
    """What Redis says of the packet: how fast it emptied, the shares handed out, over-issue against the
    shares the database drew, distinct winners."""
    async with open_core(settings.replace(database_url=db_url)) as core:
        view = await grabs.open_packet(core, packet_id=packet_id, group_id=group, user_id=admin)
        paid = sum(g.amount for g in view.grabs)
        row = await core.db.fetchone(
            "SELECT SUM(amount), COUNT(*) FROM red_packet_shares WHERE packet_id = %s", (packet_id,)
        )
        return {
            "time_to_empty_ms": view.duration_ms,
            "shares_handed_out": len(view.grabs),
            "over_issue_cents": paid - (int(row[0]) if row and row[0] is not None else 0),
            "distinct_winners": len({g.user_id for g in view.grabs}),
        }


async def credited(
    settings: Settings, db_url: str, tmp: Path, *, packet_id: PacketId, group: GroupId
) -> dict[str, Any]:
    """3. A ``redpacket worker`` credits the packet's grabs; how many it credited, how long it took, and
    what a reconciliation of the books says afterwards (with the worker stopped)."""
    s = settings.replace(
        database_url=db_url, queue_name="redpacket:bench:queue", worker_metrics_port=free_port()
    )
    async with open_core(s) as core:
        grabs_key = keys.packet_grabs(group_id=group, packet_id=packet_id)
        handed_out = int(await cast(Awaitable[int], core.redis.hlen(grabs_key)))
        worker = creditbench.start_worker(s, tmp / "worker.log")
        try:
            await creditbench.until_healthy(s, worker)
            began = time.perf_counter()
            credited = await creditbench.until_credited(core, group, [packet_id], handed_out, [], worker)
            took = time.perf_counter() - began
        finally:
            worker.terminate()
            await asyncio.to_thread(worker.wait, 60)
        with phase("reconciling the books"):
            books = await reconcile(core)
    return {
        "credited": credited,
        "credited_in_s": round(took, 2),
        "reconcile_ok": books.ok,
        "reconcile_differences": [str(d) for d in books.differences[:10]],
    }
