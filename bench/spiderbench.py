"""``redpacket bench credit --spider``: credits/s of the worker's batched path (``credit_many``, 500 a call)
on the configured MariaDB and on a sharded ledger (a MariaDB Spider head over 1, 2 and 3 backends,
``server.store.shards``), in one process with one client, rounds alternating between the four sides.

The sharded sides share one throw-away cluster (``launchers.spider``) in a temp dir: one head and three
backends, and on them three databases of their own, ``redpacket_bench_s1`` sharded over backend 0,
``_s2`` over backends 0-1, ``_s3`` over all three. Only one side runs at a time, so the head and the
backends a side does not use idle while it runs.

For each side: credits/s; CPU µs per credit of the bench process, of the database servers (the one
MariaDB; the head and each backend, read from /proc: servers on this machine only); and the round trips
of a batch: the statements the bench sent (``Tx.execute``/``executemany``/``fetchone``/``fetchall``, a
multi-row INSERT counted once as aiomysql sends it, and lone reads outside a transaction) and the
transactions it ran (each a BEGIN and a COMMIT more) — one transaction per batch on one database, one per
shard and step on a sharded ledger (``server.money.shardsteps``) — and, on the shards, the statements the
head sent the backends (their ``Questions`` counters). Each side's rows credited are counted after each
round: every side must credit exactly what it was given.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiomysql.cursors import RE_INSERT_VALUES

from bench import creditbench, plots
from bench.report import report
from launchers.spider import SpiderCluster, spider_cluster
from server.core import Core, open_core
from server.ids import ShareSeq
from server.money.crediting import credit_many
from server.money.journal import marks
from server.settings import Settings
from server.store.db import Database, Tx
from server.store.engines import connect
from server.store.records import CreditEntry
from server.store.schema import migrate
from server.store.shards import make_sharded

DATABASE = "redpacket_bench"
BATCH = 500
SHARDS = (1, 2, 3)
STATEMENTS = ("execute", "executemany", "fetchone", "fetchall")
TICKS = os.sysconf("SC_CLK_TCK")
LAYOUT = "one head over three backends; spiderN: a database of its own sharded over backends 0..N-1"


@dataclass
class Side:
    """One side of the comparison: its name in the figures, its settings, and its servers — the head's
    pid (None: read the one MariaDB's from the server), each backend's URL and pid in shard order."""

    name: str
    settings: Settings
    head: int | None = None
    backend_urls: list[str] = field(default_factory=list)
    backend_pids: list[int] = field(default_factory=list)


@dataclass
class Counts:
    """What the bench sent while counting: statements (round trips of their own) and transactions."""

    statements: int = 0
    transactions: int = 0


def _sent(tx: Tx, name: str, statement: str, params: Any) -> int:
    """How many statements one call of ``Tx.<name>`` sends: ``executemany`` sends one multi-row INSERT
    when aiomysql can make one (as ``RE_INSERT_VALUES`` says), else one statement per row."""
    if name != "executemany":
        return 1
    if not params:
        return 0
    return 1 if RE_INSERT_VALUES.match(tx.dialect.sql(statement)) else len(params)


@contextlib.contextmanager
def counting(db: Database) -> Iterator[Counts]:
    """Count the statements sent through any ``Tx`` (the class's methods wrapped: this process runs one
    client while counting) and through ``db``'s lone reads, and the transactions ``db`` opens (each a
    BEGIN and a COMMIT round trip more). Everything is put back on the way out."""
    counts = Counts()
    saved = {name: getattr(Tx, name) for name in STATEMENTS}

    def counted(name: str) -> Callable[..., Awaitable[Any]]:
        original = saved[name]

        async def call(tx: Tx, statement: str, params: Any = ()) -> Any:
            counts.statements += _sent(tx, name, statement, params)
            return await original(tx, statement, params)

        return call

    def lone(original: Callable[..., Awaitable[Any]]) -> Callable[..., Any]:
        async def call(statement: str, params: Any = ()) -> Any:
            counts.statements += 1
            return await original(statement, params)

        return call

    opened = db.transaction

    def transaction() -> AbstractAsyncContextManager[Tx]:
        counts.transactions += 1
        return opened()

    for name in STATEMENTS:
        setattr(Tx, name, counted(name))
    db.transaction = transaction  # type: ignore[method-assign]
    db.fetchone = lone(db.fetchone)  # type: ignore[method-assign]
    db.fetchall = lone(db.fetchall)  # type: ignore[method-assign]
    try:
        yield counts
    finally:
        for name, original in saved.items():
            setattr(Tx, name, original)
        for name in ("transaction", "fetchone", "fetchall"):
            vars(db).pop(name, None)


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used; 0 when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICKS


async def _server_pid(core: Core) -> int | None:
    """The pid of the MariaDB ``core`` talks to, when it runs on this machine."""
    row = await core.db.fetchone("SELECT @@pid_file")
    return _pid_in(str(row[0]) if row else "")


def _pid_in(pid_file: str) -> int | None:
    try:
        return int(Path(pid_file).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


async def _questions(backends: list[Database]) -> int:
    """The statements the backends have been sent since they started (each ``Questions``; this read
    counts one on each)."""
    total = 0
    for db in backends:
        row = await db.fetchone("SHOW GLOBAL STATUS LIKE 'Questions'")
        total += int(row[1]) if row else 0
    return total


@contextlib.asynccontextmanager
async def bench_cluster(shards: tuple[int, ...] = SHARDS) -> AsyncIterator[SpiderCluster]:
    """A head and ``max(shards)`` backends in a temp dir, and for each n in ``shards`` the database
    ``redpacket_bench_sN`` sharded over the first n backends (migrated: the deployment's id is the one
    migration gives)."""
    home = Path(tempfile.mkdtemp(prefix="redpacket-spider-bench-"))
    os.chmod(home, 0o755)  # the servers' user (mysql) must reach in
    try:
        async with spider_cluster(home / "nodes", backends=max(shards)) as cluster:
            for n in shards:
                name = f"{DATABASE}_s{n}"
                await cluster.create_database(name)
                head = await connect(cluster.head_url(name), 1)
                try:
                    await make_sharded(head, name, cluster.backend_urls(name)[:n], lambda u: connect(u, 1))
                finally:
                    await head.close()
            yield cluster
    finally:
        shutil.rmtree(home, ignore_errors=True)


async def _measure(core: Core, credits: list[CreditEntry], side: Side, head: int | None) -> dict[str, Any]:
    """``credit_many`` over ``credits``, ``BATCH`` a call: the rate, the CPU per credit of this process
    and of the servers, and the round trips (the statements and transactions sent; on shards, the
    statements the head sent the backends)."""
    n, batches = len(credits), -(-len(credits) // BATCH)
    backends = [await connect(u, 1) for u in side.backend_urls]
    try:
        asked = await _questions(backends)
        cpu, head_cpu = time.process_time(), _cpu_s(head) if head else 0.0
        backend_cpu = [_cpu_s(p) for p in side.backend_pids]
        told = 0
        with counting(core.db) as counts:
            start = time.perf_counter()
            for i in range(0, n, BATCH):
                told += sum(o == "credited" for o in await credit_many(core.db, credits[i : i + BATCH]))
            wall = time.perf_counter() - start
        bench_cpu = time.process_time() - cpu
        head_cpu = _cpu_s(head) - head_cpu if head else 0.0
        backend_cpu = [_cpu_s(p) - before for p, before in zip(side.backend_pids, backend_cpu, strict=True)]
        # (each backend counted the first read of Questions after its value was taken: one each)
        backend_statements = await _questions(backends) - asked - len(backends)
    finally:
        for b in backends:
            await b.close()

    def us(seconds: float) -> float:
        return round(seconds / n * 1e6, 1)

    got: dict[str, Any] = {"credit_many_500_per_s": round(n / wall), "bench_cpu_us": us(bench_cpu)}
    if head:
        got["servers_cpu_us"] = us(head_cpu + sum(backend_cpu))
    if side.backend_pids:
        got["head_cpu_us"] = us(head_cpu) if head else None
        got["backends_cpu_us"] = us(sum(backend_cpu))
        got.update({f"backend{i}_cpu_us": us(c) for i, c in enumerate(backend_cpu)})
    got["statements_per_batch"] = round(counts.statements / batches, 1)
    got["transactions_per_batch"] = round(counts.transactions / batches, 1)
    got["round_trips_per_credit"] = round((counts.statements + 2 * counts.transactions) / n, 3)
    if backends:
        got["backend_statements_per_batch"] = round(backend_statements / batches, 1)
    got["told_credited"] = told
    return got


async def _round(side: Side, n: int, into: dict[str, list[Any]]) -> None:
    """One round of ``side``: a world of its own (1,000 users, packets of 1,000 shares enough for ``n``
    credits), the credits cleared, then measured; the rows credited counted after."""
    async with open_core(side.settings, migrate=False) as core:
        _, group, members, pids = await creditbench.bench_world(core, 1000, -(-n // 1000) * 10_000)
        stamp = int(time.time() * 1000)
        credits = [
            CreditEntry(p, members[i], ShareSeq(i + 1), 10, stamp, group) for p in pids for i in range(1000)
        ][:n]
        head = side.head or await _server_pid(core)
        await creditbench.reset_credits(core, pids, members)
        got = await _measure(core, credits, side, head)
        row = await core.db.fetchone(  # (this round's packets: earlier rounds' records stay)
            "SELECT COUNT(*), COALESCE(SUM(amount), 0) FROM grab_records WHERE status = 'credited'"
            f" AND packet_id IN ({marks(len(pids))})",
            pids,
        )
        got["credited"], got["credited_cents"] = (int(row[0]), int(row[1])) if row else (0, 0)
        await creditbench.forget(core, group, pids)
    for k, v in got.items():
        into.setdefault(k, []).append(v)


def _median(values: list[Any]) -> Any:
    known = sorted(v for v in values if v is not None)
    return known[len(known) // 2] if known else None


async def bench_credit_spider(
    settings: Settings, rounds: int = 3, credits: int = 20_000, plot: Path | None = None
) -> dict[str, Any]:
    """The credit figures of the configured MariaDB and of a Spider head over 1, 2 and 3 backends,
    ``rounds`` each, alternating; each figure the median round's, the rates and the rows credited of
    every round too. Raises ``SpiderSetupError`` when the cluster cannot start (no ``mariadbd``, no
    Spider plugin)."""
    if not settings.database_url.startswith(("mysql", "mariadb")):
        raise ValueError(
            "bench credit --spider compares with a MariaDB: set REDPACKET_DATABASE_URL=mysql://…"
        )
    if rounds < 1 or credits < 1:
        raise ValueError("bench credit --spider needs at least one round and one credit")
    s = creditbench.bench_settings(settings, Path(tempfile.gettempdir()), creditbench.QUEUE)
    db = await connect(s.database_url, 1)
    try:
        await migrate(db)
    finally:
        await db.close()
    measured: dict[str, dict[str, list[Any]]] = {}
    async with bench_cluster() as cluster:
        sides = [Side("mariadb", s)]
        for n in SHARDS:
            name = f"{DATABASE}_s{n}"
            sides.append(
                Side(
                    f"spider{n}",
                    s.replace(database_url=cluster.head_url(name)),
                    cluster.head.pid,
                    cluster.backend_urls(name)[:n],
                    [b.pid for b in cluster.backends[:n] if b.pid is not None],
                )
            )
        for _ in range(rounds):
            for side in sides:
                await _round(side, credits, measured.setdefault(side.name, {}))
    figures: dict[str, Any] = {"rounds": rounds, "credits": credits, "batch": BATCH, "layout": LAYOUT}
    for side_name, got in measured.items():
        for k, values in got.items():
            figures[f"{side_name}_{k}"] = _median(values)
            if k in ("credit_many_500_per_s", "credited"):
                figures[f"{side_name}_{k}_rounds"] = values
    rates = {k: v for k, v in figures.items() if k.endswith("_per_s")}
    cpu = {k: v for k, v in figures.items() if k.endswith(("servers_cpu_us", "bench_cpu_us"))}
    return report(
        "credit-spider",
        figures,
        plot,
        charts=lambda d: [
            plots.bars(rates, d / "credit-spider.png", "credits/s: MariaDB vs Spider over 1-3", "credits/s"),
            plots.bars(cpu, d / "credit-spider-cpu.png", "CPU per credit", "µs"),
        ],
    )
