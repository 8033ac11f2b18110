"""``redpacket bench credit --galera`` and ``bench storm --galera``: the same measurement on the configured
MariaDB and on a throw-away three-node Galera cluster started for the run (``launchers.galera``), in
one process with one client, rounds alternating.

credit: credits/s of the worker's batched path (``credit_many``, 500 a transaction) and of one transaction
per credit (each COMMIT waits for the cluster's certification), with the CPU per credit of the bench
process and of the database servers (all three nodes for Galera; read from /proc, so only for servers on
this machine).

storm: grabs at a rate for some seconds through the core while a ``redpacket worker`` process credits
them and the bench sends a packet every 200 ms — on Galera, with the writer node killed (``kill -9``)
part-way and started again as long after, rejoining under the storm: the credit lag P99 overall and of
the worst second, the longest time no credit was committed, how long sends went unanswered, and how
long the node took to rejoin.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from bench import creditbench
from bench.report import report
from launchers.galera import GaleraCluster, galera_cluster
from server.core import Core, open_core
from server.ids import GroupId, ShareSeq, UserId
from server.money import ledger, packets
from server.money.crediting import credit_grab, credit_many
from server.settings import Settings
from server.store.engines import connect
from server.store.records import CreditEntry
from server.store.schema import migrate

DATABASE = "redpacket_bench"
STORM_FIGURES = (
    "grabs",
    "credited",
    "achieved_grabs_per_s",
    "drained_after_s",
    "lag_p50_ms",
    "lag_p99_ms",
    "lag_p99_worst_second_ms",
    "longest_no_credit_s",
)
TICKS = os.sysconf("SC_CLK_TCK")


@contextlib.asynccontextmanager
async def bench_cluster() -> AsyncIterator[GaleraCluster]:
    """A three-node cluster in a temp dir, with the bench's database migrated (the deployment's id is
    the one migration gives)."""
    home = Path(tempfile.mkdtemp(prefix="redpacket-galera-bench-"))
    os.chmod(home, 0o755)  # the nodes' user (mysql) must reach in
    try:
        async with galera_cluster(home / "nodes") as cluster:
            await cluster.create_database(DATABASE)
            db = await connect(cluster.url(DATABASE), 1)
            try:
                await migrate(db)
            finally:
                await db.close()
            yield cluster
    finally:
        shutil.rmtree(home, ignore_errors=True)


def _cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) the processes have used; 0 for one that is gone."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / TICKS


async def _server_pids(core: Core) -> list[int]:
    """The pid of the MySQL server ``core`` talks to, when it runs on this machine ([] otherwise)."""
    row = await core.db.fetchone("SELECT @@pid_file")
    return _pid_in(str(row[0]) if row else "")


def _pid_in(pid_file: str) -> list[int]:
    try:
        return [int(Path(pid_file).read_text().split()[0])]
    except (OSError, ValueError, IndexError):
        return []


async def _measured(
    work: Callable[[], Awaitable[None]], n: int, servers: list[int], into: dict[str, Any], name: str
) -> None:
    """Run ``work`` (``n`` credits): its rate, and the CPU µs per credit of this process and the servers."""
    cpu, db_cpu, start = time.process_time(), _cpu_s(servers), time.perf_counter()
    await work()
    wall = time.perf_counter() - start
    into.setdefault(f"{name}_per_s", []).append(round(n / wall))
    into.setdefault(f"{name}_client_cpu_us", []).append(round((time.process_time() - cpu) / n * 1e6, 1))
    if servers:
        into.setdefault(f"{name}_db_cpu_us", []).append(round((_cpu_s(servers) - db_cpu) / n * 1e6, 1))


async def _credit_round(
    s: Settings, servers: list[int], into: dict[str, Any], batched: int, single: int
) -> None:
    async with open_core(s, migrate=False) as core:
        _, group, members, pids = await creditbench.bench_world(core, 1000, batched * 10)
        stamp = int(time.time() * 1000)
        credits = [
            CreditEntry(p, members[i], ShareSeq(i + 1), 10, stamp, group) for p in pids for i in range(1000)
        ]
        servers = servers or await _server_pids(core)

        async def in_batches() -> None:
            for i in range(0, batched, 500):
                await credit_many(core.db, credits[i : i + 500])

        async def one_by_one() -> None:
            for c in credits[:single]:
                await credit_grab(core.db, c)

        await creditbench.reset_credits(core, pids, members)
        await _measured(in_batches, batched, servers, into, "credit_many_500")
        await creditbench.reset_credits(core, pids, members)
        await _measured(one_by_one, single, servers, into, "one_tx_per_credit")
        await creditbench.forget(core, group, pids)


async def bench_credit_galera(
    settings: Settings, rounds: int = 3, batched: int = 20_000, single: int = 2_000, plot: Path | None = None
) -> dict[str, Any]:
    """The credit figures of the configured MariaDB and of a Galera cluster, ``rounds`` each, alternating."""
    if not settings.database_url.startswith(("mysql", "mariadb")):
        raise ValueError(
            "bench credit --galera compares with a MariaDB: set REDPACKET_DATABASE_URL=mysql://…"
        )
    plain: dict[str, Any] = {}
    cluster_figures: dict[str, Any] = {}
    s = creditbench.bench_settings(settings, Path(tempfile.gettempdir()), creditbench.QUEUE)
    async with bench_cluster() as cluster:
        g = s.replace(database_url=cluster.url(DATABASE))
        nodes = [n.pid for n in cluster.nodes if n.pid is not None]
        for _ in range(rounds):
            await _credit_round(s, [], plain, batched, single)
            await _credit_round(g, nodes, cluster_figures, batched, single)
    figures: dict[str, Any] = {"rounds": rounds, "batched_credits": batched, "single_credits": single}
    for side, got in (("mariadb", plain), ("galera3", cluster_figures)):
        for k, values in got.items():
            figures[f"{side}_{k}"] = sorted(values)[len(values) // 2]  # the median round
            figures[f"{side}_{k}_rounds"] = values
    return creditbench.report_rates("credit-galera", figures, plot, "credits/s: MariaDB vs 3-node Galera")


async def bench_storm_galera(
    settings: Settings, rate: int, seconds: int, kill_after: float, plot: Path | None = None
) -> dict[str, Any]:
    """The storm on the configured MariaDB (no kill: the baseline), then on a Galera cluster whose writer
    is killed ``kill_after`` seconds into the grabs and started again as long after that (it rejoins
    while the storm goes on: a joiner catching up can hold the cluster's writes by flow control)."""
    figures: dict[str, Any] = {"rate": rate, "seconds": seconds, "kill_after_s": kill_after}
    base = await creditbench.bench_storm(settings, rate, seconds)
    for k in STORM_FIGURES:
        figures[f"mariadb_{k}"] = base.get(k)
    async with bench_cluster() as cluster:
        doomed = cluster.nodes[0]
        sends: list[tuple[float, float | None]] = []  # (asked, answered or None) on the bench's clock
        marks: dict[str, float] = {}

        async def outage(started: float) -> None:
            await asyncio.sleep(max(0.0, started + kill_after - time.perf_counter()))
            doomed.kill()
            marks["killed"] = time.perf_counter()
            await asyncio.sleep(max(0.0, started + 2 * kill_after - time.perf_counter()))
            marks["restarted"] = time.perf_counter()
            await cluster.rejoin(doomed)
            await cluster.wait_size(3)
            marks["rejoined"] = time.perf_counter()

        async def during(core: Core, group: GroupId, admin: UserId, started: float) -> None:
            await ledger.topup(core.db, admin, 100_000, f"bench-sends-{started}")
            node = asyncio.create_task(outage(started))
            try:
                await _send_every(core, admin, group, 0.2, started + seconds, sends)
            finally:
                await node

        g = settings.replace(database_url=cluster.url(DATABASE))
        run = await creditbench.bench_storm(g, rate, seconds, during=during)
        for k in STORM_FIGURES:
            figures[f"galera3_{k}"] = run.get(k)
        figures.update(_send_figures(sends, marks.get("killed")))
        if "rejoined" in marks:
            figures["galera3_rejoin_s"] = round(marks["rejoined"] - marks["restarted"], 1)
    return report("storm-galera", figures, plot, charts=lambda d: [])


async def _send_every(
    core: Core,
    admin: UserId,
    group: GroupId,
    every: float,
    until: float,
    sends: list[tuple[float, float | None]],
) -> None:
    """A 1-share packet every ``every`` seconds until ``until``: when each was asked and answered (None:
    it failed)."""
    n = 0
    while time.perf_counter() < until:
        asked = time.perf_counter()
        try:
            await packets.send_packet(core, sender_id=admin, group_id=group, kind="lucky", total=1, count=1,
                                      request_id=f"bench-send-{asked}-{n}")  # fmt: skip
            sends.append((asked, time.perf_counter()))
        except Exception:
            sends.append((asked, None))
        n += 1
        await asyncio.sleep(max(0.0, asked + every - time.perf_counter()))


def _send_figures(sends: list[tuple[float, float | None]], killed: float | None) -> dict[str, Any]:
    """How long sends went unanswered: from the kill to the first answer of a send asked after it, the
    slowest send, the longest time between two answers (the kill's, or the rejoin's), how many failed."""
    answered = [(a, d) for a, d in sends if d is not None]
    after = [d for a, d in answered if killed is not None and a >= killed]
    done = sorted(d for _, d in answered)
    return {
        "galera3_sends": len(sends),
        "galera3_sends_failed": len(sends) - len(answered),
        "galera3_slowest_send_s": round(max((d - a for a, d in answered), default=0.0), 2),
        "galera3_longest_between_sends_s": round(
            max((b - a for a, b in itertools.pairwise(done)), default=0.0), 2
        ),
        "galera3_sends_answered_again_after_kill_s": round(min(after) - killed, 2)
        if after and killed
        else None,
    }
