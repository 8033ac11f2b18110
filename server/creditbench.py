"""``redpacket bench credit``: credits/s of the worker beside a raw batched insert of the same rows and
beside one transaction per credit, all in one run on the configured database (MariaDB with
``REDPACKET_DATABASE_URL=mysql://...``; a throw-away SQLite file otherwise)."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from server import groups, ledger, packets
from server.bench import fresh_ids
from server.core import Core, open_core
from server.crediting import add_to_balances, credit_many
from server.ledger import Credit, credit_grab
from server.settings import Settings

QUEUE = "redpacket:bench:credit"


async def _reset(core: Core, users: list[int]) -> None:
    async with core.db.transaction() as tx:
        await tx.execute("DELETE FROM grab_records")
        await tx.execute("DELETE FROM journal WHERE kind = 'grab'")
        await tx.execute(
            f"UPDATE accounts SET balance = 0 WHERE user_id IN ({', '.join(['%s'] * len(users))})", users
        )


async def _raw(core: Core, credits: list[Credit], batch: int) -> None:
    """The same rows written with no checks at all: the floor the worker is measured against."""
    for i in range(0, len(credits), batch):
        chunk = credits[i : i + batch]
        ts = ledger.now_ms()
        async with core.db.transaction() as tx:
            await tx.executemany(
                "INSERT INTO grab_records (packet_id, user_id, seq, amount, status, grabbed_ms, credited_ms)"
                " VALUES (%s, %s, %s, %s, %s, %s, %s)",
                [(c.packet_id, c.user_id, c.seq, c.amount, "credited", c.grabbed_ms, ts) for c in chunk],
            )
            await tx.executemany(
                "INSERT INTO journal (account_id, amount, kind, idem_key, packet_id, created_ms)"
                " VALUES (%s, %s, %s, %s, %s, %s)",
                [
                    (c.user_id, c.amount, "grab", f"grab:{c.packet_id}:{c.seq}", c.packet_id, ts)
                    for c in chunk
                ],
            )
            per: dict[int, int] = defaultdict(int)
            for c in chunk:
                per[c.user_id] += c.amount
            await add_to_balances(tx, dict(per), ts)


async def bench_credit(settings: Settings, credits_n: int = 20_000, single_n: int = 2_000) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="redpacket-bench-"))
    s = settings.with_(
        database_url=settings.database_url or f"sqlite:///{tmp / 'bench.sqlite3'}",
        max_count=1000,
        max_total_cents=10**9,
        queue_name=QUEUE,
        redis_pool_size=256,
    )
    figures: dict[str, Any] = {"credits": credits_n, "database": s.database_url.split(":", 1)[0]}
    try:
        async with open_core(s) as core:
            if s.database_url.startswith("sqlite"):
                await fresh_ids(core)
            stamp = ledger.now_ms()
            users = await ledger.create_users(core.db, [f"c{stamp}_{i}" for i in range(1000)])
            await ledger.topup(core.db, users[0], credits_n * 10, f"bench{stamp}")
            group = await groups.create_group(core.db, users[0], "credit bench")
            await groups.add_members(core.db, core.membership, group, users[1:])
            credits: list[Credit] = []
            while len(credits) < credits_n:
                p = await packets.send_packet(core, users[0], group, "equal", 10 * 1000, 1000)
                credits += [Credit(p.packet_id, users[i], i + 1, 10, stamp) for i in range(1000)]
            credits = credits[:credits_n]

            await _reset(core, users)
            start = time.perf_counter()
            await _raw(core, credits, 500)
            figures["raw_batched_insert_per_s"] = round(credits_n / (time.perf_counter() - start))

            await _reset(core, users)
            start = time.perf_counter()
            for i in range(0, credits_n, 500):
                await credit_many(core.db, credits[i : i + 500])
            figures["credit_many_500_per_s"] = round(credits_n / (time.perf_counter() - start))

            await _reset(core, users)
            from worker.main import make_worker

            for c in credits:
                await packets.enqueue_credit(core, c)
            w = make_worker(core, burst=True, poll_delay=0, cron_jobs=[], max_jobs=200)
            start = time.perf_counter()
            await w.async_run()
            figures["worker_per_s"] = round(credits_n / (time.perf_counter() - start))
            sizes = w.ctx["batcher"].sizes
            figures["worker_jobs"] = {
                "complete": w.jobs_complete,
                "failed": w.jobs_failed,
                "retried": w.jobs_retried,
            }
            figures["worker_batches"] = len(sizes)
            figures["worker_mean_batch"] = round(sum(sizes) / max(len(sizes), 1), 1)
            paid = await core.db.fetchone("SELECT COUNT(*), COALESCE(SUM(amount), 0) FROM grab_records")
            figures["worker_paid"] = [int(paid[0]), int(paid[1])] if paid else None

            await _reset(core, users)
            start = time.perf_counter()
            for c in credits[:single_n]:
                await credit_grab(core.db, c)
            figures["one_tx_per_credit_per_s"] = round(single_n / (time.perf_counter() - start))
            await core.redis.delete(QUEUE)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    figures["worker_vs_raw"] = round(figures["worker_per_s"] / figures["raw_batched_insert_per_s"], 3)
    figures["worker_vs_one_tx"] = round(figures["worker_per_s"] / figures["one_tx_per_credit_per_s"], 1)
    print("credit benchmark")
    for k, v in figures.items():
        print(f"  {k:<28} {v}")
    print(json.dumps({"bench": "credit", **figures}))
    return figures
