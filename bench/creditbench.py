"""``redpacket bench credit``: credits/s of the worker beside a raw batched insert of the same rows and
beside one transaction per credit, all in one run on the configured database (MariaDB with
``REDPACKET_DATABASE_URL=mysql://...``; a throw-away SQLite file otherwise)."""

from __future__ import annotations

import asyncio
import itertools
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, cast

from bench import plots
from bench.grabbench import drop_bench_credits, fresh_ids
from bench.progress import phase
from bench.report import report
from launchers.throwaway import free_port
from server.core import Core, open_core
from server.ids import GroupId, PacketId, ShareSeq, UserId
from server.live import announce
from server.money import grabs, groups, ledger, packets
from server.money.crediting import credit_grab, credit_many
from server.money.events import credits_key
from server.money.journal import add_to_balances, marks
from server.money.statuses import PacketStatus
from server.settings import Settings, child_env
from server.store import keys
from server.store.records import CreditEntry

QUEUE = "redpacket:bench:credit"


def p99(values: list[int]) -> float:
    ordered = sorted(values)
    return float(ordered[max(0, int(len(ordered) * 0.99) - 1)]) if ordered else 0.0


async def _enqueue(core: Core, credits: list[CreditEntry]) -> None:
    """Record each credit as its grab would have: the grab in its packet's grabs hash, an entry in its
    group's shard outbox."""
    for i in range(0, len(credits), 1000):
        async with core.redis.pipeline(transaction=False) as pipe:
            for c in credits[i : i + 1000]:
                grabs_key = keys.packet_grabs(group_id=c.group_id, packet_id=c.packet_id)
                pipe.hset(grabs_key, str(c.user_id), c.record.encode())
                pipe.xadd(keys.outbox_for(c.group_id), {"c": c.encode()})
            await pipe.execute()


async def forget(core: Core, group: GroupId, pids: list[PacketId]) -> None:
    """The bench's Redis leftovers: its packets' keys and any credit records still in the outboxes."""
    for pid in pids:
        await core.redis.delete(*keys.packet_keys(group_id=group, packet_id=pid))
    await drop_bench_credits(core, set(pids))


async def reset_credits(core: Core, pids: list[PacketId], users: list[UserId]) -> None:
    """Every credit of the bench's packets undone, and no other packet's or user's rows touched (earlier
    runs' stay as they were): their grab records, grab journal rows and the events of both deleted, the
    packets active again, their grabbers (who hold nothing else) back to 0. What is left reconciles clean.
    (A ledger in use is refused before: ``server.cli.bench``.)"""
    p, u = marks(len(pids)), marks(len(users))
    tokens = await core.db.fetchall(
        f"SELECT DISTINCT tx FROM journal WHERE kind = 'grab' AND tx IS NOT NULL AND packet_id IN ({p})", pids
    )
    gone = [credits_key(int(t)) for (t,) in tokens] + [ledger.finished_key(pid) for pid in pids]
    async with core.db.transaction() as tx:
        await tx.execute(f"DELETE FROM grab_records WHERE packet_id IN ({p})", pids)
        await tx.execute(f"DELETE FROM journal WHERE kind = 'grab' AND packet_id IN ({p})", pids)
        for i in range(0, len(gone), 1000):
            chunk = gone[i : i + 1000]
            await tx.execute(f"DELETE FROM events WHERE idem_key IN ({marks(len(chunk))})", chunk)
        await tx.execute(
            f"UPDATE red_packets SET status = '{PacketStatus.ACTIVE}', finished_ms = NULL, credited_count = 0"
            f" WHERE id IN ({p})",
            pids,
        )
        await tx.execute(f"UPDATE accounts SET balance = 0 WHERE user_id IN ({u})", users)


async def _raw(core: Core, credits: list[CreditEntry], batch: int) -> None:
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
                    (c.user_id, c.amount, "grab", ledger.grab_key(c.packet_id, c.seq), c.packet_id, ts)
                    for c in chunk
                ],
            )
            per: dict[int, int] = defaultdict(int)
            for c in chunk:
                per[c.user_id] += c.amount
            await add_to_balances(tx, dict(per), ts)


def bench_settings(settings: Settings, tmp: Path, queue: str) -> Settings:
    return settings.replace(
        database_url=settings.database_url or f"sqlite:///{tmp / 'bench.sqlite3'}",
        max_count=1000,
        max_total_cents=10**9,
        queue_name=queue,
        redis_pool_size=256,
    )


async def bench_world(
    core: Core, members: int, money: int
) -> tuple[UserId, GroupId, list[UserId], list[PacketId]]:
    """An admin with ``money``, ``members`` others in one group, and packets of 1,000 equal 10-cent
    shares spending it: (admin, group, members, packet ids)."""
    if core.settings.database_url.startswith("sqlite"):
        await fresh_ids(core)
    stamp = ledger.now_ms()
    users = await ledger.create_users(core.db, [f"b{stamp}_{i}" for i in range(members + 1)])
    admin, others = users[0], users[1:]
    await ledger.topup(core.db, admin, money, f"bench{stamp}")
    group = await groups.create_group(core.db, admin, "bench")
    await groups.add_members(core.db, core.membership, group, others)
    await core.membership.is_member(group_id=group, user_id=admin)  # warm the member cache
    pids = []
    for _ in range(money // 10_000):
        p = await packets.send_packet(
            core, sender_id=admin, group_id=group, kind="equal", total=10 * 1000, count=1000
        )
        # Announced as a hub's send is: left unannounced, a worker's sweep put each one up again (a
        # second of its loop, mid-storm, for 60 packets) as if Redis had been away when it was sent.
        if await announce.announce_packet(core, p) is None:
            raise RuntimeError("the bench packet could not be announced")
        pids.append(p.packet_id)
    return admin, group, others, pids


ROUNDS = 3  # of the raw insert, credit_many and the drain, alternating: each figure is their median


async def _timed(run: Callable[[], Awaitable[object]], n: int) -> tuple[float, float]:
    """``run()``'s ``n`` credits a second, and this process's CPU a credit in µs."""
    cpu, start = time.process_time(), time.perf_counter()
    await run()
    wall = time.perf_counter() - start
    return n / wall, (time.process_time() - cpu) / n * 1e6


async def bench_credit(
    settings: Settings, credits_n: int = 20_000, single_n: int = 2_000, plot: Path | None = None
) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="redpacket-bench-"))
    s = bench_settings(settings, tmp, QUEUE)
    figures: dict[str, Any] = {"credits": credits_n, "database": s.database_url.split(":", 1)[0]}
    try:
        async with open_core(s) as core:
            _, group, members, pids = await bench_world(core, 1000, credits_n * 10)
            stamp = ledger.now_ms()
            credits = [
                CreditEntry(p, members[i], ShareSeq(i + 1), 10, stamp, group)
                for p in pids
                for i in range(1000)
            ]

            from worker.drain import CreditDrain
            from worker.main import collecting_as_a_worker

            async def many() -> None:
                for i in range(0, credits_n, 500):
                    await credit_many(core.db, credits[i : i + 500])

            phases: dict[str, Callable[[], Awaitable[object]]] = {
                "raw": lambda: _raw(core, credits, 500),
                "credit_many": many,
                "drain": lambda: CreditDrain(core).until_empty(),
            }
            # Every timed phase follows the same reset: the rows of one untimed pass deleted (InnoDB purges
            # them while the next phase runs). Timed first after setup instead, the raw insert ran on a
            # quiet server and was 20-30 % faster than the same insert timed after a reset. The phases
            # alternate, ROUNDS times: one round's raw insert alone varied from 21,000 to 36,000/s.
            await reset_credits(core, pids, members)
            await _raw(core, credits, 500)
            timed: dict[str, list[tuple[float, float]]] = {name: [] for name in phases}
            with collecting_as_a_worker():  # (as `redpacket worker` does; both sides alike)
                for _ in range(ROUNDS):
                    for name, run in phases.items():
                        await reset_credits(core, pids, members)
                        if name == "drain":
                            await _enqueue(core, credits)
                        timed[name].append(await _timed(run, credits_n))
            paid = await core.db.fetchone(
                f"SELECT COUNT(*), COALESCE(SUM(amount), 0) FROM grab_records WHERE packet_id IN"
                f" ({marks(len(pids))})",
                pids,
            )
            figures["drain_paid"] = [int(paid[0]), int(paid[1])] if paid else None
            for name, key in (("raw", "raw_batched_insert"), ("credit_many", "credit_many_500")):
                figures[f"{key}_per_s"] = round(statistics.median(r for r, _ in timed[name]))
            figures["worker_drain_per_s"] = round(statistics.median(r for r, _ in timed["drain"]))
            ratios = [d / r for (d, _), (r, _) in zip(timed["drain"], timed["raw"], strict=True)]
            figures["drain_vs_raw_rounds"] = [round(x, 3) for x in ratios]
            figures["drain_vs_raw"] = round(statistics.median(ratios), 3)
            # This process's CPU a credit (the database's and Redis's are not in it).
            figures["cpu_us_per_credit"] = {
                name: round(statistics.median(c for _, c in runs), 1) for name, runs in timed.items()
            }

            await reset_credits(core, pids, members)
            start = time.perf_counter()
            for c in credits[:single_n]:
                await credit_grab(core.db, c)
            figures["one_tx_per_credit_per_s"] = round(single_n / (time.perf_counter() - start))
            await forget(core, group, pids)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    figures["drain_vs_one_tx"] = round(figures["worker_drain_per_s"] / figures["one_tx_per_credit_per_s"], 1)
    return report_rates("credit", figures, plot, "credits/s: the drain beside its baselines")


def report_rates(name: str, figures: dict[str, Any], plot: Path | None, title: str) -> dict[str, Any]:
    """``report``, its chart (``name.png``) the bars of the credits/s (the figures ending ``_per_s``)."""
    rates = {k: v for k, v in figures.items() if k.endswith("_per_s")}
    return report(
        name, figures, plot, charts=lambda d: [plots.bars(rates, d / f"{name}.png", title, "credits/s")]
    )


# Work beside a storm's grabs (``bench.galerabench``: sends, a node killed): given the core, the
# bench's group and admin, and when the grabs started (``time.perf_counter``).
During = Callable[[Core, GroupId, UserId, float], Awaitable[None]]


async def bench_storm(
    settings: Settings,
    rate: int = 2_000,
    seconds: int = 30,
    plot: Path | None = None,
    during: During | None = None,
    reconcile_at: float | None = None,
) -> dict[str, Any]:
    """Grabs at ``rate``/s for ``seconds`` through the core while a ``redpacket worker`` process
    credits them: grab → credited latency, and the queue backlog sampled every second. ``during``: run
    beside the grabs. ``reconcile_at``: that many seconds into the grabs, the worker is asked for a
    reconciliation (its periodic job, queued at once)."""
    tmp = Path(tempfile.mkdtemp(prefix="redpacket-bench-"))
    s = bench_settings(settings, tmp, "redpacket:bench:storm")
    total = rate * seconds
    figures: dict[str, Any] = {
        "rate": rate,
        "seconds": seconds,
        "grabs": total,
        "database": s.database_url[:5],
    }
    try:
        async with open_core(s) as core:
            admin, group, grabbers, pids = await bench_world(core, 1000, total * 10)
            worker_log = tmp / "worker.log"
            s = s.replace(worker_metrics_port=free_port())
            worker_started = time.time()
            worker = start_worker(s, worker_log)
            backlog: list[int] = []
            try:
                # The grabs start once the worker is healthy: started together, every grab of the first
                # second waited out the worker's start-up (about 1 s), which was then P99 of the lag.
                booting = time.perf_counter()
                await until_healthy(s, worker)
                figures["worker_ready_s"] = round(time.perf_counter() - booting, 2)
                start, started_at = time.perf_counter(), time.time()
                jobs = [(p, u) for p in pids for u in grabbers]
                beside = [during(core, group, admin, start)] if during else []
                if reconcile_at is not None:
                    beside.append(ask_reconciliation(core, reconcile_at))
                await asyncio.gather(
                    grab_at(core, group, jobs, rate=rate, seconds=seconds, backlog=backlog), *beside
                )
                figures["achieved_grabs_per_s"] = round(total / (time.perf_counter() - start))
                credited = await until_credited(core, group, pids, total, backlog, worker)
                figures["drained_after_s"] = round(time.perf_counter() - start, 1)
                # The worker reconciles as it starts (and every tenth minute): when its last one ended, in
                # seconds from the first grab (None: none ended while this worker ran).
                ended = await cast(Awaitable[bytes | None], core.redis.hget(keys.reconciled(), "at"))
                at = float(ended) if ended is not None else 0.0
                figures["reconciled_at_s"] = round(at - started_at, 1) if at >= worker_started else None
            finally:
                worker.terminate()
                await asyncio.to_thread(worker.wait, 60)
            if credited < total:  # what the worker said, to tell why (its exit code: None while it ran)
                said = worker_log.read_text(errors="replace")[-6000:]
                print(f"worker (exit {worker.returncode}) credited {credited:,} of {total:,}; its log ends:\n"
                      f"{said}", file=sys.stderr, flush=True)  # fmt: skip
            samples = await lags(core, pids, backlog, figures)
            await forget(core, group, pids)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    title = f"storm: {rate:,} grabs/s for {seconds} s"
    return report(
        "storm",
        figures,
        plot,
        charts=lambda d: [plots.lag_and_backlog(samples, d / "storm-lag-backlog.png", title)],
    )


def start_worker(s: Settings, log: Path) -> subprocess.Popen[bytes]:
    """The ``redpacket worker`` under test, on the bench's Redis, database and queue; what it says goes
    to ``log``."""
    env = child_env(
        REDPACKET_REDIS_URL=s.redis_url,
        REDPACKET_DATABASE_URL=s.database_url,
        REDPACKET_QUEUE_NAME=s.queue_name,
        REDPACKET_QUEUE_REDIS_URL=s.queue_redis_url,
        REDPACKET_GRAB_DURABILITY=s.grab_durability,
        REDPACKET_WORKER_METRICS_PORT=str(s.worker_metrics_port),
    )
    with log.open("ab") as out:  # (the child holds its own copy of the file)
        return subprocess.Popen(
            [sys.executable, "-m", "server", "worker"], env=env, stdout=out, stderr=subprocess.STDOUT
        )


async def grab_at(
    core: Core,
    group: GroupId,
    jobs: list[tuple[PacketId, UserId]],
    *,
    rate: int,
    seconds: int,
    backlog: list[int],
) -> None:
    """Each (packet, user) grabs, ``rate`` a second in ticks of 10 ms; the outbox's length sampled into
    ``backlog`` once a second."""
    total = rate * seconds
    tasks: list[asyncio.Task[Any]] = []
    start = time.perf_counter()
    tick = 0.01
    per_tick = max(1, int(rate * tick))
    with phase(f"grabbing at {rate:,}/s for {seconds} s", total=total) as grabbing:
        for i in range(0, len(jobs), per_tick):
            due = start + (i // per_tick) * tick
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks += [
                asyncio.create_task(grabs.grab(core, packet_id=p, group_id=group, user_id=u))
                for p, u in jobs[i : i + per_tick]
            ]
            if i % rate < per_tick:
                backlog.append(int(await core.redis.xlen(keys.outbox_for(group))))
                grabbing.update(i)
        await asyncio.gather(*tasks)
        grabbing.update(total)


async def ask_reconciliation(core: Core, after: float) -> None:
    """``after`` seconds from now, queue the worker's reconciliation job, as its tenth-minute tick does."""
    from worker.main import cron_name
    from worker.settle import reconcile_job

    await asyncio.sleep(after)
    await core.queue.enqueue_job(cron_name(core.namespace, reconcile_job))


async def until_healthy(s: Settings, worker: subprocess.Popen[bytes]) -> None:
    """Wait (up to 60 s, or until ``worker`` has exited) until ``worker`` is healthy, as ``worker --check``
    says (``worker.main.health``): it reached Redis and the database, its drain running beside."""
    from worker.main import health

    deadline = time.perf_counter() + 60
    while time.perf_counter() < deadline and worker.poll() is None:
        if (await asyncio.to_thread(health, s))[0]:
            return
        await asyncio.sleep(0.05)
    raise RuntimeError(f"the worker (exit {worker.poll()}) was not healthy within 60 s")


async def until_credited(
    core: Core,
    group: GroupId,
    pids: list[PacketId],
    total: int,
    backlog: list[int],
    worker: subprocess.Popen[bytes],
) -> int:
    """Wait (up to 300 s, or until ``worker`` has exited) for the worker to credit all ``total`` grabs;
    the backlog sampled each second. How many it credited."""
    deadline = time.perf_counter() + 300
    credited = 0
    with phase("crediting", total=total) as crediting:
        while time.perf_counter() < deadline:
            row = await core.db.fetchone(
                "SELECT COUNT(*) FROM grab_records WHERE status = 'credited'"
                f" AND packet_id IN ({', '.join(['%s'] * len(pids))})",
                pids,
            )
            depth = int(await core.redis.xlen(keys.outbox_for(group)))
            backlog.append(depth)
            credited = int(row[0]) if row else 0
            crediting.update(credited)
            if credited >= total or worker.poll() is not None:
                break
            await asyncio.sleep(1)
    return credited


async def lags(
    core: Core, pids: list[PacketId], backlog: list[int], figures: dict[str, Any]
) -> list[dict[str, float]]:
    """The credit lags into ``figures``; the P99 lag of the grabs of each second, beside the backlog
    sampled that second (for the plot)."""
    marks = ", ".join(["%s"] * len(pids))
    rows = await core.db.fetchall(
        f"SELECT credited_ms - grabbed_ms, grabbed_ms FROM grab_records WHERE packet_id IN ({marks})",
        pids,
    )
    lags = sorted(int(r[0]) for r in rows)
    per_second: dict[int, list[int]] = {}
    first = min((int(r[1]) for r in rows), default=0)
    for lag, grabbed in rows:
        per_second.setdefault((int(grabbed) - first) // 1000, []).append(int(lag))
    samples = [
        {"t": float(t), "lag_ms": p99(per_second.get(t, [])), "backlog": float(depth)}
        for t, depth in enumerate(backlog)
    ]
    figures["credited"] = len(lags)
    if lags:
        figures["lag_p50_ms"] = int(statistics.median(lags))
        figures["lag_p99_ms"] = int(p99(lags))
        figures["lag_p99_worst_second_ms"] = int(max(p99(v) for v in per_second.values()))
        committed = sorted(int(r[0]) + int(r[1]) for r in rows)  # when each credit was committed
        gaps = [b - a for a, b in itertools.pairwise(committed)]
        figures["longest_no_credit_s"] = round(max(gaps, default=0) / 1000, 2)
    figures["backlog_per_s"] = backlog
    return samples
