"""``redpacket bench grab``: grabs per second through the core, beside the raw Redis figure.

Measured in one run, on this machine, against the configured Redis — one server or a cluster (the
embedded Valkey by default):
  - the core's ``grab()`` (membership check, grab script, credit record) from one Python process:
    one at a time, 200 concurrent sending each call alone, and 200 concurrent with batching;
  - the hub's grab (block and rate limit too) spread over 12 groups (so over shards and masters), under
    each durability level the server allows as it is configured: grabs/s, grab P50/P99, and the Redis CPU
    each grab cost, in all and per master;
  - the grab script alone from the same process, one at a time and 200 concurrent batched;
  - ``redis-benchmark`` running EVALSHA of the same grab script with 50 clients on the packet's master,
    without and with pipelining (the ceiling one Redis core gives).
Setup uses a throw-away SQLite file; every bench key is deleted at the end. Prints a table, then one JSON
line.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import plots
from bench.progress import phase
from bench.report import report
from server.core import Core, open_core
from server.durability import DURABILITY
from server.errors import RedPacketError
from server.ids import GroupId, PacketId, ShareSeq, UserId
from server.money import grabs, groups, ledger, packets
from server.money.membership import Membership
from server.settings import Settings
from server.store import keys
from server.store.batch import Batcher, durability_problem
from server.store.records import CreditEntry, ShareEntry

BENCH_QUEUE = "redpacket:bench:queue"


async def _grab_all(
    core: Core, *, packet_id: PacketId, group_id: GroupId, users: list[UserId], concurrency: int
) -> float:
    outcomes: dict[str, int] = {}

    async def lane(mine: list[UserId]) -> None:
        for u in mine:
            outcome: str
            try:
                outcome = (await grabs.grab(core, packet_id=packet_id, group_id=group_id, user_id=u)).outcome
            except RedPacketError as e:
                outcome = f"{e.code}: {e.message}"
            outcomes[outcome] = outcomes.get(outcome, 0) + 1

    start = time.perf_counter()
    await asyncio.gather(*(lane(users[i::concurrency]) for i in range(concurrency)))
    elapsed = time.perf_counter() - start
    if outcomes != {"won": len(users)}:
        raise RuntimeError(f"bench expected {len(users)} wins, got {outcomes}")
    return len(users) / elapsed


async def _script_only(
    core: Core, *, packet_id: PacketId, group_id: GroupId, n: int, concurrency: int
) -> float:
    """The grab script alone (its credit enqueue included, no member check): what the client side costs."""
    base = 10**9 + concurrency * 10**7

    async def lane(lane_no: int) -> None:
        for i in range(lane_no, n, concurrency):
            user = UserId(base + i)
            call = grabs.grab_call(
                core, packet_id=packet_id, group_id=group_id, user_id=user, check_members=False, gate=False
            )
            # Sent as it is, with no wait for durability: the script's own cost is the baseline.
            answer = await core.batcher.script(core.scripts.get(call.SCRIPT), call.keys(), call.argv())
            reply = call.parse(answer)
            if reply.status != "won":
                raise RuntimeError(f"bench grab answered {reply.status!r}")

    start = time.perf_counter()
    await asyncio.gather(*(lane(i) for i in range(concurrency)))
    return n / (time.perf_counter() - start)


async def _redis_benchmark(
    core: Core, *, group_id: GroupId, packet_id: PacketId, pipeline: int
) -> float | None:
    """``redis-benchmark`` EVALSHA of the grab script (no member check, no gate), 50 clients, on the
    master that owns the packet (the script is loaded there first)."""
    exe = shutil.which("redis-benchmark") or shutil.which("valkey-benchmark")
    if exe is None:
        return None
    call = grabs.grab_call(
        core, packet_id=packet_id, group_id=group_id, user_id=UserId(0), check_members=False, gate=False
    )
    k, args = call.keys(), call.argv()
    node = core.nodes.node_client(k[0])
    await node.script_load(core.scripts.sources["grab"])
    kwargs = node.connection_pool.connection_kwargs
    cmd = [
        exe, "-h", str(kwargs.get("host", "127.0.0.1")), "-p", str(kwargs.get("port", 6379)),
        "--dbnum", str(kwargs.get("db", 0)),
        "-n", "200000", "-c", "50", "-P", str(pipeline), "-r", "100000000", "-q",
        "EVALSHA", core.scripts.sha("grab"), str(len(k)), *k, "__rand_int__", *map(str, args[1:]),
    ]  # fmt: skip
    done = await asyncio.to_thread(
        subprocess.run, cmd, capture_output=True, text=True, timeout=300, check=True
    )
    m = re.findall(r"([\d.]+) requests per second", done.stdout)
    return float(m[-1]) if m else None


async def _raw_packet(core: Core, group_id: GroupId, shares: int) -> PacketId:
    """A packet that lives only in Redis, big enough that redis-benchmark's grabs keep winning."""
    packet_id = PacketId(10**15 + int(time.time()))
    meta, pile, _, _ = keys.packet_keys(group_id=group_id, packet_id=packet_id)
    far = ledger.now_ms() + 3600_000
    fields = {"group": group_id, "expires_ms": far, "target": "", "count": shares}
    async with core.redis.pipeline(transaction=False) as pipe:
        pipe.hset(meta, mapping=fields)
        for start in range(1, shares + 1, 10_000):
            batch = range(start, min(start + 10_000, shares + 1))
            pipe.rpush(pile, *[ShareEntry(ShareSeq(i), 1).encode() for i in batch])
        await pipe.execute()
    for key in keys.packet_keys(group_id=group_id, packet_id=packet_id):
        await core.redis.pexpire(key, 3600_000)
    return packet_id


async def drop_bench_credits(core: Core, packet_ids: set[PacketId]) -> None:
    """Take the bench's credit records out of the shard outboxes (they name packets of the bench's
    throw-away database; a worker of a system sharing this Redis would refuse them)."""
    for n in range(keys.SHARDS):
        outbox = keys.credit_outbox(n)
        ids = [
            entry_id
            for entry_id, fields in await core.redis.xrange(outbox)
            if CreditEntry.parse(fields[b"c"]).packet_id in packet_ids
        ]
        for i in range(0, len(ids), 1000):
            await core.redis.xdel(outbox, *ids[i : i + 1000])


async def fresh_ids(core: Core) -> None:
    """Start a throw-away SQLite database's packet, group and user ids where no earlier run's Redis keys
    can be (ids restart at 1 in a new file; the bench's Redis may still hold an old packet 1)."""
    start = ledger.now_ms()
    await core.db.run(
        lambda tx: tx.executemany(
            "INSERT INTO sqlite_sequence (name, seq) VALUES (%s, %s)",
            [("red_packets", start), ("chat_groups", start), ("users", start)],
        ),
        idempotent=False,
    )


async def _durability_ready(core: Core, level: str) -> str | None:
    """Why ``level`` cannot be had on this Redis as it is configured, or None if it can."""
    for name, client in core.nodes.masters().items():
        problem = await durability_problem(client, level)
        if problem is not None:
            return f"{name}: {problem}"
    return None


async def _spread_storm(
    core: Core, admin: UserId, targets: list[GroupId], users: list[UserId], concurrency: int, gate: bool
) -> dict[str, Any]:
    """Every user grabs once, in the group ``targets[user index % len(targets)]`` (each its own packet),
    ``concurrency`` at a time: grabs/s, grab latency, and Redis CPU per grab, in all and per master."""
    per_group = [users[i :: len(targets)] for i in range(len(targets))]
    sent = [
        await packets.send_packet(
            core, sender_id=admin, group_id=g, kind="equal", total=len(members) * 10, count=len(members)
        )
        for g, members in zip(targets, per_group, strict=True)
    ]
    jobs = [
        (p.packet_id, g, u) for p, g, members in zip(sent, targets, per_group, strict=True) for u in members
    ]
    for p in sent:  # the first grab of a packet after a (re)start checks it: not measured
        await packets.recover_packet(core, p.packet_id)
    latencies: list[float] = []
    outcomes: dict[str, int] = {}

    async def lane(mine: list[tuple[PacketId, GroupId, UserId]]) -> None:
        for packet_id, group_id, u in mine:
            t = time.perf_counter()
            outcome: str
            try:
                grabbed = await grabs.grab(core, packet_id=packet_id, group_id=group_id, user_id=u, gate=gate)
                outcome = grabbed.outcome
            except RedPacketError as e:
                outcome = f"{e.code}: {e.message}"
            latencies.append(time.perf_counter() - t)
            outcomes[outcome] = outcomes.get(outcome, 0) + 1

    cpu = await core.nodes.cpu_seconds()
    start = time.perf_counter()
    await asyncio.gather(*(lane(jobs[i::concurrency]) for i in range(concurrency)))
    elapsed = time.perf_counter() - start
    used = {name: t - cpu[name] for name, t in (await core.nodes.cpu_seconds()).items()}
    if outcomes != {"won": len(jobs)}:
        raise RuntimeError(f"bench expected {len(jobs)} wins, got {outcomes}")
    latencies.sort()
    n = len(jobs)
    handled: dict[str, int] = dict.fromkeys(used, 0)
    for packet_id, group_id, _ in jobs:
        client = core.nodes.node_client(keys.packet_shares(group_id=group_id, packet_id=packet_id))
        handled[core.nodes.address(client.connection_pool.connection_kwargs)] += 1
    return {
        "grabs_per_s": round(n / elapsed),
        "p50_ms": round(latencies[n // 2] * 1000, 2),
        "p99_ms": round(latencies[int(n * 0.99) - 1] * 1000, 2),
        # Redis CPU of all masters over all grabs; and of each master over the grabs it handled.
        "redis_cpu_us_per_grab": round(sum(used.values()) * 1e6 / n, 1),
        "per_master": {
            k: {"grabs": handled[k], "cpu_us_per_grab": round(v * 1e6 / max(handled[k], 1), 1)}
            for k, v in sorted(used.items())
        },
        "packets": [p.packet_id for p in sent],
    }


SWEEP = (1, 4, 16, 64, 256)


@dataclasses.dataclass
class _Leftovers:
    """What the bench leaves in Redis, taken out at its end: its packets' keys and credit records."""

    keys: list[str] = dataclasses.field(default_factory=list)
    packets: set[PacketId] = dataclasses.field(default_factory=set)

    def add(self, groups: list[GroupId], packet_id: PacketId) -> None:
        self.packets.add(packet_id)
        self.keys += [k for g in groups for k in keys.packet_keys(group_id=g, packet_id=packet_id)]

    async def drop(self, core: Core, groups: list[GroupId]) -> None:
        for key in self.keys:
            await core.redis.unlink(key)
        await drop_bench_credits(core, self.packets)
        for g in groups:
            await core.redis.delete(*[keys.group_members(g), keys.group_members_version(g)])


async def run_grab_bench(
    settings: Settings, grabs: int, groups_n: int = 12, plot: Path | None = None
) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="redpacket-bench-"))
    s = settings.replace(
        database_url=f"sqlite:///{tmp / 'bench.sqlite3'}",
        max_count=grabs,
        max_total_cents=grabs * 10,
        queue_name=BENCH_QUEUE,
        # Unbatched, 200 coroutines each hold a connection per call; fewer connections than callers
        # starves some waiters past the pool timeout (redis-py's BlockingConnectionPool is not FIFO).
        redis_pool_size=256,
        grabs_per_second=1000.0,
        grabs_burst=1000,
    )
    figures: dict[str, Any] = {
        "grabs_per_mode": grabs,
        "redis": "cluster" if s.redis_url.startswith("redis+cluster") else "one server",
    }
    try:
        async with open_core(s) as core:
            figures["masters"] = len(core.nodes.masters())
            world = await _grab_world(core, grabs, groups_n)
            figures["groups"] = len(world.spread)
            figures["shards"] = len({keys.shard(g) for g in world.spread})
            left = _Leftovers()
            await _measure_grabs(core, world, left, figures)
            await left.drop(core, world.spread)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    raw_c50 = figures["redis_benchmark_evalsha_c50"]
    if raw_c50:
        figures["core_batched_vs_raw_c50"] = round(figures["core_200_concurrent_batched"] / raw_c50, 3)
        figures["script_batched_vs_raw_c50"] = round(
            figures["script_only_200_concurrent_batched"] / raw_c50, 3
        )
    rows = [
        (r["concurrency"], float(r["grabs_per_s"]), float(r["script_per_s"]))
        for r in figures["concurrency_sweep"]
    ]
    return report(
        "grab",
        figures,
        plot,
        charts=lambda d: [
            plots.throughput(
                rows, d / "grab-throughput.png", "grabs/s against concurrency (baseline: the script alone)"
            )
        ],
        heading=f"grab benchmark: {grabs} grabs per mode, Redis {settings.redis_url}",
        missing="n/a (redis-benchmark not found)",
    )


@dataclass(frozen=True)
class _World:
    """What the grab bench grabs in: the admin who sends, the groups the grabs spread over, the users."""

    admin: UserId
    spread: list[GroupId]
    users: list[UserId]


async def _grab_world(core: Core, n: int, groups_n: int) -> _World:
    """``n`` users, the first of them the admin with money enough for every mode; ``groups_n`` groups
    of them all, their member caches warm."""
    await fresh_ids(core)
    users = await ledger.create_users(core.db, [f"bench{i}" for i in range(n)])
    admin = users[0]
    sweep_n = min(n, 5_000)
    await ledger.topup(core.db, admin, 10 * n * 10 + len(SWEEP) * sweep_n * 10, "bench")
    spread = [await groups.create_group(core.db, admin, "bench")]
    for i in range(groups_n - 1):
        spread.append(await groups.create_group(core.db, admin, f"bench{i}"))
    for g in spread:
        await groups.add_members(core.db, core.membership, g, users)
        await core.membership.is_member(group_id=g, user_id=admin)  # warm the member cache
    return _World(admin, spread, users)


async def _measure_grabs(core: Core, world: _World, left: _Leftovers, figures: dict[str, Any]) -> None:
    """Every mode of the grab bench, in turn, into ``figures``."""
    admin, users = world.admin, world.users
    n, group = len(users), world.spread[0]
    one_by_one = Batcher(core.nodes, core.batcher.durability, core.settings.durability_timeout_ms, 1)
    unbatched = dataclasses.replace(
        core,
        batcher=one_by_one,
        membership=Membership(core.db, core.redis, core.scripts, 300, one_by_one),
    )
    modes = [
        ("core_sequential", unbatched, 1),
        ("core_200_concurrent", unbatched, 200),
        ("core_200_concurrent_batched", core, 200),
    ]
    for name, c, concurrency in modes:
        p = await packets.send_packet(c, sender_id=admin, group_id=group, kind="equal", total=n * 10, count=n)
        left.add([group], p.packet_id)
        with phase(f"{name}: {n:,} grabs"):
            rate = await _grab_all(
                c, packet_id=p.packet_id, group_id=group, users=users, concurrency=concurrency
            )
            figures[name] = round(rate)
    await _durability_levels(core, world, left, figures)
    raw = await _raw_packet(core, group, 1_200_000)
    left.add([group], raw)
    rate = await _script_only(unbatched, packet_id=raw, group_id=group, n=n, concurrency=1)
    figures["script_only_sequential"] = round(rate)
    rate = await _script_only(core, packet_id=raw, group_id=group, n=n, concurrency=200)
    figures["script_only_200_concurrent_batched"] = round(rate)
    figures["concurrency_sweep"] = await _sweep(core, admin, group, users[: min(n, 5_000)], left)
    for pipeline, name in ((1, "redis_benchmark_evalsha_c50"), (16, "redis_benchmark_evalsha_c50_p16")):
        figures[name] = await _redis_benchmark(core, group_id=group, packet_id=raw, pipeline=pipeline)


async def _durability_levels(core: Core, world: _World, left: _Leftovers, figures: dict[str, Any]) -> None:
    """The hub's grab (block and rate limit included) spread over the groups' shards, under each
    durability level the server allows as configured, in this run."""
    admin, spread, users = world.admin, world.spread, world.users
    for level in DURABILITY:
        why_not = await _durability_ready(core, level)
        if why_not is not None:
            figures[f"durability_{level}"] = f"n/a ({why_not})"
            continue
        durable = dataclasses.replace(
            core,
            settings=core.settings.replace(grab_durability=level),
            batcher=Batcher(core.nodes, level, core.settings.durability_timeout_ms),
        )
        with phase(f"durability {level}: {len(users):,} grabs over {len(spread)} groups"):
            got = await _spread_storm(durable, admin, spread, users, 200, gate=True)
        for pid in got.pop("packets"):
            left.add(spread, pid)
        figures[f"durability_{level}"] = got


async def _sweep(
    core: Core, admin: UserId, group: GroupId, users: list[UserId], left: _Leftovers
) -> list[dict[str, int]]:
    """Throughput against concurrency: the hub's grab (batched) beside the bare script, same client."""
    sweep: list[dict[str, int]] = []
    n = len(users)
    raw_sweep = await _raw_packet(core, group, len(SWEEP) * n)  # its own grabbers' ids
    left.add([group], raw_sweep)
    with phase("concurrency sweep", total=len(SWEEP)) as step:
        for concurrency in SWEEP:
            p = await packets.send_packet(
                core, sender_id=admin, group_id=group, kind="equal", total=n * 10, count=n
            )
            left.add([group], p.packet_id)
            hub_rate = await _grab_all(
                core, packet_id=p.packet_id, group_id=group, users=users, concurrency=concurrency
            )
            script_rate = await _script_only(
                core, packet_id=raw_sweep, group_id=group, n=n, concurrency=concurrency
            )
            sweep.append(
                {
                    "concurrency": concurrency,
                    "grabs_per_s": round(hub_rate),
                    "script_per_s": round(script_rate),
                }
            )
            step.advance()
    return sweep
