"""``redpacket bench db-read``: a lone database read as the hub makes it (one statement) beside the same
read in a transaction, on the configured database."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from bench import plots
from bench.report import report
from server.core import open_core
from server.settings import Settings


async def run_db_read_bench(
    settings: Settings, reads: int = 4000, concurrency: int = 50, plot: Path | None = None
) -> dict[str, Any]:
    """A lone read (the welcome's groups, a sync's packets) the way ``Database.fetchone`` does it, against
    the same read in its own BEGIN ... COMMIT transaction (how every read went before), on the configured
    database: reads/s and this process's CPU per read, each twice, alternating."""
    from server.store.db import Row

    figures: dict[str, Any] = {"database": settings.effective_database_url.split(":", 1)[0], "reads": reads}
    async with open_core(settings) as core:  # migrated: the users table is there
        db = core.db
        sql = "SELECT id, name FROM users WHERE id = %s"

        async def in_transaction(i: int) -> Row | None:
            async with db.transaction() as tx:
                return await tx.fetchone(sql, (i,))

        ways: dict[str, Callable[[int], Awaitable[Row | None]]] = {
            "transaction": in_transaction,
            "lone_read": lambda i: db.fetchone(sql, (i,)),
        }
        for run in (1, 2):
            for name, read in ways.items():
                cpu, start = time.process_time(), time.perf_counter()
                for i in range(0, reads, concurrency):
                    await asyncio.gather(*(read(j) for j in range(i, i + concurrency)))
                wall, used = time.perf_counter() - start, time.process_time() - cpu
                figures[f"{name}_per_s_{run}"] = round(reads / wall)
                figures[f"{name}_cpu_us_{run}"] = round(used * 1e6 / reads)
    rates = {k: v for k, v in figures.items() if "_per_s_" in k}
    return report(
        "db-read",
        figures,
        plot,
        charts=lambda d: [plots.bars(rates, d / "db-read.png", "lone read vs in a transaction", "reads/s")],
    )
