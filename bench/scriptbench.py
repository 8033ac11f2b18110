"""``redpacket bench grab-script``: what one call of ``lua/grab.lua`` costs Redis, and what variants of it
cost, on a throw-away ``redis-server`` of the bench's own (issue 26, step 5).

Every run grabs on the same data, made afresh: ``GROUPS`` groups, one in each shard, of ``MEMBERS``
members, each with a packet of as many shares (loaded by ``lua/load_packet.lua``), every shard's gate
holding a few blocks and throttles of other users; every member grabs once, in turn over the groups, as
the hub does (check the member cache, the block list and the rate limit at the settings' defaults), and
wins. The calls go ``PIPELINE`` to a round trip, as the hub's batcher sends them. Per run: the server's
CPU (``INFO cpu``, user + sys) per call, read once the rate-limit keys the run made have expired (their
expiry is part of a grab's cost), and the time Redis counted inside the EVALSHA (``INFO commandstats``).
Variants alternate (A B C, then C B A, ...); a figure is the median of its runs.

With ``instructions`` the server runs under valgrind's callgrind and each run counts the instructions
it executed per call: the same from run to run whatever else the machine does, so a difference of 1% is
seen, where CPU time on a shared machine moves by 10%. (Instructions are not time: a cache miss costs
many. Both are printed.)

``ablations`` measures what each command of the script costs: the script as it is, and the script with
one command answered by a stub instead of Redis (a prelude that shadows ``redis.call``); the difference
is that command, its call from Lua and the conversion of its reply included. Beside them: the gate off,
the member check off, and an empty script with the grab's KEYS and ARGV (the cost of any call at all).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import redis

from bench.progress import phase
from bench.report import report
from launchers.throwaway import Server, Setup, command, throwaway_server
from server.ids import GroupId, PacketId, ShareSeq, UserId
from server.store import keys
from server.store.records import ShareEntry
from server.store.scriptcalls import Arg, GrabCall, GrabRate, LoadPacketCall
from server.store.scripts import LUA_DIR, read_sources

GROUPS = 64
MEMBERS = 1_000
PIPELINE = 50
RATE = GrabRate(5.0, 10)  # the settings' defaults (grabs_per_second, grabs_burst)
GATE_ENTRIES = 4  # blocks, and as many throttles, of users who do not grab, in every shard's gate


@dataclass(frozen=True)
class Variant:
    """One script to measure, and how it is called."""

    name: str
    source: str
    gate: bool = True
    check_members: bool = True


# A stub answers a command on one of the script's KEYS (by index; 0: a command with no key) with a Lua
# value, the one the real command gives on the path every run takes (a member, no block, a share...).
# Not HSET grabs: without it the grabs hash stays empty, and the HGET before it no longer scans.
STUBS: dict[str, tuple[str, int, str]] = {
    "SMISMEMBER members": ("SMISMEMBER", 4, "{1, 1}"),
    "TIME": ("TIME", 0, "{'%d', '0'}"),  # (the seconds filled in when the stub is made)
    "HMGET gate": ("HMGET", 5, "{false, false}"),
    "GET bucket": ("GET", 6, "false"),
    "SET bucket": ("SET", 6, "{ok = 'OK'}"),
    "HMGET meta": ("HMGET", 1, "{ARGV[2], '99999999999999', '', false}"),
    "HGET grabs": ("HGET", 3, "false"),
    "LPOP shares": ("LPOP", 2, "'1:100'"),
    "XADD outbox": ("XADD", 7, "'1-1'"),
    "LLEN shares": ("LLEN", 2, "1"),
}


def stubbed(source: str, names: list[str]) -> str:
    """``source`` with the commands of ``STUBS[names]`` answered by their stubs. With no name, only the
    stubs' own cost (the shadowing ``redis.call``: two table lookups): the baseline the stubbed variants
    compare with."""
    lines = ["local real_call = redis.call", "local stubs = {}"]
    for name in names:
        command, key, value = STUBS[name]
        value = value.replace("%d", str(int(time.time())))
        lines.append(f"stubs['{command}'] = stubs['{command}'] or {{}}")
        on = f"KEYS[{key}]" if key else "''"
        lines.append(f"stubs['{command}'][{on}] = function() return {value} end")
    lines += [
        "local redis = {call = function(command, ...)",
        "  local on = stubs[command]",
        "  local stub = on and on[(...) or '']",
        "  if stub then return stub() end",
        "  return real_call(command, ...)",
        "end}",
    ]
    return "\n".join(lines) + "\n" + source


def ablations(source: str) -> list[Variant]:
    """The script with no command stubbed, then with each in turn; the gate off; the member check off;
    an empty script."""
    return [
        Variant("stubs, none stubbed", stubbed(source, [])),
        *(Variant(f"stubbed: {name}", stubbed(source, [name])) for name in STUBS),
        Variant("gate off (no block list, no rate limit)", source, gate=False),
        Variant("member check off", source, check_members=False),
        Variant("empty script, same KEYS and ARGV", "return {'won', '1:100:1', 1}"),
    ]


@dataclass(frozen=True)
class Shape:
    """How many groups (one a shard, up to ``keys.SHARDS``) and members each; a packet has a share each."""

    groups: int = GROUPS
    members: int = MEMBERS


def _world(r: redis.Redis, sources: dict[str, str], shape: Shape) -> list[GrabCall]:
    """Fresh data (the server flushed first) and the grabs that win on it, in the order they are sent."""
    command(r, "FLUSHALL")
    now = int(time.time() * 1000)
    far = now + 86_400_000
    load = _sha(command(r, "SCRIPT", "LOAD", sources["load_packet"]))
    members = shape.members
    for g in range(1, shape.groups + 1):
        group = GroupId(g)
        users = [g * 1_000_000 + i for i in range(members)]
        command(r, "SADD", keys.group_members(group), keys.LOADED, *users)
        command(r, "EXPIRE", keys.group_members(group), 3600)
        meta: dict[str, Arg] = {
            "group": g, "sender": 1, "kind": "lucky", "total": members * 100, "count": members,
            "greeting": "", "target": "", "created_ms": now, "expires_ms": far,
        }  # fmt: skip
        shares = [ShareEntry(ShareSeq(i + 1), 50 + i % 100) for i in range(members)]
        call = LoadPacketCall(
            group_id=group, packet_id=PacketId(g), expire_at_ms=far, meta=meta, shares=shares, grabs={}
        )
        command(r, "EVALSHA", load, len(call.keys()), *call.keys(), *call.argv())
    for n in {keys.shard(GroupId(g)) for g in range(1, shape.groups + 1)}:
        others = [10**9 + n * 100 + i for i in range(GATE_ENTRIES)]
        for u in others:
            command(r, "HSET", keys.shard_gate(n), f"b:{u}", far, f"t:{u + 50}", f"1:{far}")
        command(r, "XGROUP", "CREATE", keys.credit_outbox(n), keys.CREDIT_GROUP, "$", "MKSTREAM")
    return [
        GrabCall(
            user_id=UserId(g * 1_000_000 + i),
            group_id=GroupId(g),
            packet_id=PacketId(g),
            check_members=True,
            rate=RATE,
            rewrite_repeat=False,
        )
        for i in range(members)
        for g in range(1, shape.groups + 1)
    ]


_NOT_INSIDE = {"cmdstat_evalsha", "cmdstat_info", "cmdstat_config", "cmdstat_script"}


def _sha(reply: bytes | str) -> str:
    return reply.decode() if isinstance(reply, bytes) else reply


def _expires(r: redis.Redis) -> int:
    return int(command(r, "INFO", "keyspace").get("db0", {}).get("expires", 0))


def _cpu(r: redis.Redis) -> float:
    info = command(r, "INFO", "cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def _run(server: Server, variant: Variant, sources: dict[str, str], shape: Shape) -> dict[str, Any]:
    """One run of ``variant`` on fresh data: CPU µs per call, EVALSHA µs per call (and instructions)."""
    r = server.client()
    calls = [replace(c, check_members=variant.check_members, rate=RATE if variant.gate else None)
             for c in _world(r, sources, shape)]  # fmt: skip
    sha = _sha(command(r, "SCRIPT", "LOAD", variant.source))
    expiring = _expires(r)
    command(r, "CONFIG", "RESETSTAT")
    server.zero()
    cpu = _cpu(r)
    outcomes: dict[str, int] = {}
    for i in range(0, len(calls), PIPELINE):
        batch = calls[i : i + PIPELINE]
        pipe = r.pipeline(transaction=False)
        for c in batch:
            k = c.keys()
            pipe.execute_command("EVALSHA", sha, len(k), *k, *c.argv())  # type: ignore[no-untyped-call]
        for c, reply in zip(batch, pipe.execute(), strict=True):
            status = c.parse(reply).status
            outcomes[status] = outcomes.get(status, 0) + 1
    deadline = time.monotonic() + 30  # the rate-limit keys live two intervals (400 ms at 5 a second)
    while _expires(r) > expiring and time.monotonic() < deadline:
        time.sleep(0.05)
    used = _cpu(r) - cpu
    figures: dict[str, Any] = {"cpu_us": round(used * 1e6 / len(calls), 2)}
    if server.dump is not None:
        figures["instructions"] = round(server.instructions() / len(calls))
    stats = command(r, "INFO", "commandstats")
    figures["evalsha_us"] = float(stats.get("cmdstat_evalsha", {}).get("usec_per_call", 0))
    # Each command the script ran, as Redis timed it: µs per grab (the Lua around it not included).
    figures["inside_us"] = {
        name.removeprefix("cmdstat_"): round(float(v["usec"]) / len(calls), 2)
        for name, v in stats.items()
        if name not in _NOT_INSIDE and int(v["calls"]) >= len(calls) // 2
    }
    if outcomes != {"won": len(calls)}:
        raise RuntimeError(f"{variant.name}: expected {len(calls)} won, got {outcomes}")
    return figures


def bench_grab_script(
    scripts: list[Path],
    rounds: int,
    setup: Setup,
    instructions: bool,
    with_ablations: bool,
    shape: Shape | None = None,
    config: Sequence[str] = (),
) -> dict[str, Any]:
    """Every variant ``rounds`` times, alternating, on one throw-away server; the medians. ``scripts``:
    variants of lua/grab.lua, taking its KEYS and ARGV (by default lua/grab.lua itself); with
    ``with_ablations`` the ablations of the first."""
    sources = read_sources(LUA_DIR)
    scripts = scripts or [LUA_DIR / "grab.lua"]
    variants = [Variant(p.name, p.read_text(encoding="utf-8")) for p in scripts]
    if with_ablations:
        variants += ablations(variants[0].source)
    # Under callgrind a call costs ~50 times the CPU: a quarter of the groups (the same packets).
    shape = shape or Shape(GROUPS // 4 if instructions else GROUPS)
    runs: dict[str, list[dict[str, Any]]] = {v.name: [] for v in variants}
    with throwaway_server(setup, callgrind=instructions, config=config) as server:
        version = command(server.client(), "INFO", "server")["redis_version"]
        with phase(f"{len(variants)} variants x {rounds} rounds", total=rounds * len(variants)) as step:
            for n in range(rounds):
                for v in variants if n % 2 == 0 else variants[::-1]:
                    runs[v.name].append(_run(server, v, sources, shape))
                    step.advance()
    figures: dict[str, Any] = {
        "redis": " ".join([f"redis-server {version}, {setup.value}", *config]),
        "calls_per_run": shape.groups * shape.members,
        "rounds": rounds,
    }
    for name, got in runs.items():
        row: dict[str, Any] = {k: statistics.median(x[k] for x in got) for k in ("cpu_us", "evalsha_us")}
        if "instructions" in got[0]:
            row["instructions"] = statistics.median(x["instructions"] for x in got)
        inside = {c: statistics.median(x["inside_us"].get(c, 0.0) for x in got) for c in got[0]["inside_us"]}
        row["inside_us"] = dict(sorted(inside.items(), key=lambda kv: -kv[1]))
        row["cpu_us_runs"] = [x["cpu_us"] for x in got]
        figures[name] = row
    return report("grab-script", figures, heading="grab script: Redis CPU per call, medians of runs")
