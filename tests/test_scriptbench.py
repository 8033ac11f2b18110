"""``redpacket bench grab-script`` on a throw-away server of its own, in a small shape: every variant it
measures — the script, each ablation, the script as the cluster's masters carry it — still wins every
grab (the bench checks each reply), and each figure is there (never asserted as a timing)."""

from __future__ import annotations

from pathlib import Path

from bench.scriptbench import STUBS, Shape, bench_grab_script
from launchers.throwaway import Setup
from server.store.scripts import LUA_DIR
from tests.redisproc import needs_redis_server

SMALL = Shape(groups=3, members=40)


@needs_redis_server
def test_every_ablation_still_wins_every_grab() -> None:
    figures = bench_grab_script([], 1, Setup.PLAIN, instructions=False, with_ablations=True, shape=SMALL)
    assert figures["calls_per_run"] == 120
    names = [k for k in figures if k not in ("redis", "calls_per_run", "rounds")]
    assert names[0] == "grab.lua" and len(names) == 1 + 1 + len(STUBS) + 3, names
    script = figures["grab.lua"]
    assert script["cpu_us"] > 0 and script["evalsha_us"] > 0
    # What Redis timed inside the script: every command of a won grab, the gate's included.
    assert {"smismember", "time", "hmget", "get", "set", "hget", "lpop", "hset", "xadd", "llen"} <= set(
        script["inside_us"]
    ), script
    assert "get" not in figures["gate off (no block list, no rate limit)"]["inside_us"]
    assert "xadd" not in figures["stubbed: XADD outbox"]["inside_us"]


@needs_redis_server
def test_a_variant_runs_on_a_cluster_master_with_its_log_its_replica_and_options_given(
    tmp_path: Path,
) -> None:
    variant = tmp_path / "variant.lua"
    variant.write_text((LUA_DIR / "grab.lua").read_text())
    config = ["--hash-max-listpack-entries", "16"]
    figures = bench_grab_script(
        [variant], 1, Setup.CLUSTER_AOF_REPLICA, False, False, shape=SMALL, config=config
    )
    assert figures["redis"].endswith("cluster-aof-replica --hash-max-listpack-entries 16")
    assert figures["variant.lua"]["cpu_us"] > 0
