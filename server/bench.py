"""``redpacket bench grab``: grabs per second through the core, beside the raw Redis figure.

Measured in one run, on this machine, against the configured Redis (the embedded Valkey by default):
  - the core's ``grab()`` (membership check, grab script, credit enqueue) from one Python process:
    one at a time, 200 concurrent sending each call alone, and 200 concurrent with batching;
  - the grab script alone from the same process, one at a time and 200 concurrent batched;
  - ``redis-benchmark`` running EVALSHA of the same grab script with 50 clients, without and with
    pipelining (the ceiling one Redis core gives).
Setup uses a throw-away SQLite file; every bench key is deleted at the end. Prints a table, then one JSON
line.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from server import groups, keys, ledger, packets
from server.batch import Batcher
from server.core import Core, open_core
from server.errors import RedPacketError
from server.membership import Membership
from server.settings import Settings

BENCH_QUEUE = "redpacket:bench:queue"


async def _grab_all(core: Core, packet_id: int, group_id: int, users: list[int], concurrency: int) -> float:
    outcomes: dict[str, int] = {}

    async def lane(mine: list[int]) -> None:
        for u in mine:
            outcome: str
            try:
                outcome = (await packets.grab(core, packet_id, group_id, u)).outcome
            except RedPacketError as e:
                outcome = f"{e.code}: {e.message}"
            outcomes[outcome] = outcomes.get(outcome, 0) + 1

    start = time.perf_counter()
    await asyncio.gather(*(lane(users[i::concurrency]) for i in range(concurrency)))
    elapsed = time.perf_counter() - start
    if outcomes != {"won": len(users)}:
        raise RuntimeError(f"bench expected {len(users)} wins, got {outcomes}")
    return len(users) / elapsed


async def _script_only(core: Core, packet_id: int, group_id: int, n: int, concurrency: int) -> float:
    """The grab script alone (its credit enqueue included, no member check): what the client side costs."""
    base = 10**9 + concurrency * 10**7

    async def lane(lane_no: int) -> None:
        for i in range(lane_no, n, concurrency):
            k, args = packets.grab_call(core, packet_id, group_id, base + i, False, False)
            res = await packets.call_script(core, core.scripts.grab, k, args)
            if res[0] != b"won":
                raise RuntimeError(f"bench grab answered {res[0]!r}")

    start = time.perf_counter()
    await asyncio.gather(*(lane(i) for i in range(concurrency)))
    return n / (time.perf_counter() - start)


def _redis_benchmark(core: Core, url: str, group_id: int, packet_id: int, pipeline: int) -> float | None:
    exe = shutil.which("redis-benchmark") or shutil.which("valkey-benchmark")
    if exe is None:
        return None
    u = urlparse(url)
    k, args = packets.grab_call(core, packet_id, group_id, 0, False, False)
    db = u.path.lstrip("/") or "0"
    cmd = [
        exe, "-h", u.hostname or "127.0.0.1", "-p", str(u.port or 6379), "--dbnum", db,
        "-n", "200000", "-c", "50", "-P", str(pipeline), "-r", "100000000", "-q",
        "EVALSHA", core.scripts.sha("grab"), str(len(k)), *k, "__rand_int__", *map(str, args[1:]),
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True).stdout
    m = re.findall(r"([\d.]+) requests per second", out)
    return float(m[-1]) if m else None


async def _raw_packet(core: Core, group_id: int, shares: int) -> int:
    """A packet that lives only in Redis, big enough that redis-benchmark's grabs keep winning."""
    packet_id = 10**15 + int(time.time())
    meta, pile, _, _ = keys.packet_keys(group_id, packet_id)
    far = ledger.now_ms() + 3600_000
    fields = {"group": group_id, "expires_ms": far, "target": "", "count": shares}
    async with core.redis.pipeline(transaction=False) as pipe:
        pipe.hset(meta, mapping=fields)
        for start in range(1, shares + 1, 10_000):
            pipe.rpush(pile, *[f"{i}:1" for i in range(start, min(start + 10_000, shares + 1))])
        await pipe.execute()
    for key in keys.packet_keys(group_id, packet_id):
        await core.redis.pexpire(key, 3600_000)
    return packet_id


async def drop_bench_credits(core: Core, packet_ids: set[int]) -> None:
    """Take the bench's credit records out of the shard outboxes (they name packets of the bench's
    throw-away database; a worker of a system sharing this Redis would refuse them)."""
    for n in range(keys.SHARDS):
        outbox = keys.credit_outbox(n)
        ids = [
            entry_id
            for entry_id, fields in await core.redis.xrange(outbox)
            if keys.parse_credit_entry(fields[b"c"])[0] in packet_ids
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
        )
    )


async def run_grab_bench(settings: Settings, grabs: int) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="redpacket-bench-"))
    s = settings.with_(
        database_url=f"sqlite:///{tmp / 'bench.sqlite3'}",
        max_count=grabs,
        max_total_cents=grabs * 10,
        queue_name=BENCH_QUEUE,
        # Unbatched, 200 coroutines each hold a connection per call; fewer connections than callers
        # starves some waiters past the pool timeout (redis-py's BlockingConnectionPool is not FIFO).
        redis_pool_size=256,
    )
    figures: dict[str, Any] = {"grabs_per_mode": grabs}
    cleanup: list[str] = []
    bench_packets: set[int] = set()
    try:
        async with open_core(s) as core:
            await fresh_ids(core)
            users = await ledger.create_users(core.db, [f"bench{i}" for i in range(grabs)])
            admin = users[0]
            await ledger.topup(core.db, admin, 3 * grabs * 10, "bench")
            group = await groups.create_group(core.db, admin, "bench")
            await groups.add_members(core.db, core.membership, group, users)
            await core.membership.is_member(group, admin)  # warm the member cache
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
                p = await packets.send_packet(c, admin, group, "equal", grabs * 10, grabs)
                cleanup += keys.packet_keys(group, p.packet_id)
                bench_packets.add(p.packet_id)
                figures[name] = round(await _grab_all(c, p.packet_id, group, users, concurrency))
            raw = await _raw_packet(core, group, 1_200_000)
            cleanup += keys.packet_keys(group, raw)
            bench_packets.add(raw)
            figures["script_only_sequential"] = round(await _script_only(unbatched, raw, group, grabs, 1))
            figures["script_only_200_concurrent_batched"] = round(
                await _script_only(core, raw, group, grabs, 200)
            )
            url = s.redis_url
            figures["redis_benchmark_evalsha_c50"] = await asyncio.to_thread(
                _redis_benchmark, core, url, group, raw, 1
            )
            figures["redis_benchmark_evalsha_c50_p16"] = await asyncio.to_thread(
                _redis_benchmark, core, url, group, raw, 16
            )
            for key in cleanup:
                await core.redis.unlink(key)
            await drop_bench_credits(core, bench_packets)
            await core.redis.delete(*[keys.group_members(group), keys.group_members_version(group)])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    raw_c50 = figures["redis_benchmark_evalsha_c50"]
    if raw_c50:
        figures["core_batched_vs_raw_c50"] = round(figures["core_200_concurrent_batched"] / raw_c50, 3)
        figures["script_batched_vs_raw_c50"] = round(
            figures["script_only_200_concurrent_batched"] / raw_c50, 3
        )
    print(f"grab benchmark: {grabs} grabs per mode, Redis {settings.redis_url}")
    for k, v in figures.items():
        print(f"  {k:<36} {v if v is not None else 'n/a (redis-benchmark not found)'}")
    print(json.dumps({"bench": "grab", **figures}))
    return figures
