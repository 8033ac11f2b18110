"""Small benchmark runs as an operator starts them: their figures' JSON line, and the PNG plots
``--plot DIR`` writes (figures are measured, never asserted as timings: only that the runs are right)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from contextlib import AsyncExitStack
from pathlib import Path

import pytest

from server.core import Core
from server.money import grabs, packets
from server.money.reconcile import reconcile
from server.settings import child_env
from tests.books import run_worker
from tests.conftest import make_world


def _bench(redis_url: str, *args: str) -> tuple[dict[str, object], str]:
    run = subprocess.run(
        [sys.executable, "-m", "server", "bench", *args],
        env=child_env(REDPACKET_REDIS_URL=redis_url),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-5000:]
    return json.loads(run.stdout.strip().splitlines()[-1]), run.stderr


def _png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5_000, path


def test_the_hot_packet_bench_plots_its_latencies(redis_url: str, tmp_path: Path) -> None:
    figures, said = _bench(redis_url, "hot", "--clients", "300", "--plot", str(tmp_path))
    assert figures["over_issue_cents"] == 0 and figures["distinct_winners"] == 300
    assert figures["outcomes"] == {"won": 300}
    for name in ("hot-latency.png", "hot-latency-over-time.png"):
        _png(tmp_path / name)
        assert f"plot: {tmp_path / name}" in said
    assert "hub: 300 grabs of one 300-share packet" in said  # the phases are shown as they run
    # Then a worker credits every share handed out, and the books reconcile.
    assert figures["shares_handed_out"] == figures["credited"] == 300
    assert figures["reconcile_ok"] is True and figures["reconcile_differences"] == []


def test_the_hot_packet_bench_refuses_a_room_its_processes_cannot_hold(redis_url: str) -> None:
    """A room past what the server processes' open-file limits allow is refused before anything starts,
    not minutes into the connecting."""
    run = subprocess.run(
        [sys.executable, "-m", "server", "bench", "hot", "--clients", "100000", "--hubs", "2"],
        env=child_env(REDPACKET_REDIS_URL=redis_url),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, run.stdout + run.stderr
    assert "100,000 clients need more than 2 server process(es)" in run.stderr
    assert "give --hubs" in run.stderr and "making" not in run.stderr


def test_the_hot_packet_bench_spreads_a_room_over_hub_processes(redis_url: str) -> None:
    """``--hubs``: separate hub processes on one Redis, each holding its share of the room; the packet is
    handed out and credited exactly once across them."""
    figures, _ = _bench(redis_url, "hot", "--clients", "400", "--hubs", "2")
    assert figures["hubs"] == 2 and figures["client_procs"] == 2
    assert figures["hub_connections"] == [200, 200]
    assert figures["outcomes"] == {"won": 400}
    assert figures["shares_handed_out"] == figures["credited"] == figures["distinct_winners"] == 400
    assert figures["over_issue_cents"] == 0 and figures["reconcile_ok"] is True
    assert figures["hub_finished_received"] == 400  # every member, on either hub, saw the result
    assert "gc" not in " ".join(figures)  # several processes: no one hub's collector figures


def test_the_storm_bench_plots_credit_lag_and_backlog(redis_url: str, tmp_path: Path) -> None:
    figures, _ = _bench(redis_url, "storm", "--rate", "500", "--seconds", "2", "--plot", str(tmp_path))
    assert figures["credited"] == figures["grabs"] == 1000
    _png(tmp_path / "storm-lag-backlog.png")


def test_the_token_bench_measures_each_kind_beside_the_old_check(redis_url: str, tmp_path: Path) -> None:
    figures, _ = _bench(redis_url, "tokens", "--plot", str(tmp_path))
    kinds = (
        "old_hmac_string",
        "jwt_hs256",
        "jwt_rs256",
        "jwt_es256",
        "jwt_rs256_pem_each_time",
        "jwt_hs256_seen_before",
    )
    assert all(float(figures[f"{k}_cpu_us_per_check"]) > 0 for k in kinds), figures  # type: ignore[arg-type]
    _png(tmp_path / "tokens-cpu.png")


def test_the_frame_bench_measures_every_core_answering_every_request(redis_url: str) -> None:
    """Pure CPU (no service): each side parsed every request frame and framed a reply (the bench refuses
    figures otherwise), and says what a frame cost it."""
    figures, _ = _bench(redis_url, "frames")
    assert figures["frames"] == 50_000
    for side in ("websockets", "wsproto", "hub"):
        assert float(figures[f"{side}_cpu_us_per_frame"]) > 0, figures  # type: ignore[arg-type]


def test_the_batcher_bench_measures_both_sides_coalescing_alike(redis_url: str) -> None:
    """The hub's batcher beside stock redis-py pipelines of the same ticks: each side's CPU per call over
    its alternating rounds, and both sides put a tick's calls in one pipeline (100 callers: 100 deep)."""
    figures, _ = _bench(redis_url, "batcher")
    for side in ("batcher", "stock"):
        rounds = figures[f"{side}_cpu_us_per_call_rounds"]
        assert isinstance(rounds, list) and len(rounds) == 6 and min(rounds) > 0, figures
        assert figures[f"{side}_calls_per_pipeline"] == 100.0, figures


def test_the_hub_grab_bench_runs_each_phase_for_the_seconds_given(redis_url: str) -> None:
    """--seconds: long enough to profile the hub. Each phase ran, every grab won (the bench checks each
    reply), and the hub's pid is said for a profiler to attach to."""
    figures, said = _bench(redis_url, "hub-grab", "--seconds", "2")
    assert figures["seconds"] == 2.0
    for count in ("hub_grabs", "hub_pings", "bare_echoes"):
        assert isinstance(figures[count], int) and figures[count] > 0, figures
    assert "hub grabs (hub pid " in said
    for per in ("hub_cpu_us_per_grab", "hub_cpu_us_per_ping", "bare_cpu_us_per_echo"):
        assert isinstance(figures[per], int) and figures[per] > 0, figures
    # Redis's floor went in pipelines as deep as the grabs did, as the hub's own counters said.
    depth = figures["hub_redis_calls_per_pipeline"]
    assert isinstance(depth, float) and depth >= 1, figures
    assert figures["redis_floor_depth"] == max(1, round(depth)), figures
    floor = figures["redis_floor_cpu_us_per_call"]
    assert isinstance(floor, float) and floor > 0, figures
    assert figures["redis_grab_to_floor"] == round(figures["redis_cpu_us_per_grab"] / floor, 1), figures  # type: ignore[operator]


@pytest.mark.parametrize("core", ["sqlite", "mysql"], indirect=True)
async def test_the_credit_bench_undoes_only_its_own_credits(core: Core) -> None:
    """``bench credit`` on a database holding other packets' credits (an earlier run's) pays and undoes its
    own packets' credits only: the others stay paid, every phase paid every credit it was given, and the
    ledger reconciles clean after it. (It once deleted every grab record of the database; a ledger in use
    is refused by the command: ``test_cli``.)"""
    from bench.creditbench import bench_credit

    w = await make_world(core, members=2, admin_cents=10_000)
    p = await packets.send_packet(core, sender_id=w.admin, group_id=w.group, kind="lucky", total=500, count=2)
    for u in w.members:
        await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=u)
    assert await run_worker(core) == 2
    theirs = "SELECT COUNT(*), SUM(amount) FROM grab_records WHERE packet_id = %s"
    assert await core.db.fetchone(theirs, (p.packet_id,)) == (2, 500)

    figures = await bench_credit(core.settings, credits_n=2_000, single_n=50)
    assert figures["drain_paid"] == [2_000, 20_000]
    assert set(figures["cpu_us_per_credit"]) == {"raw", "credit_many", "drain"}
    assert len(figures["drain_vs_raw_rounds"]) == 3
    assert await core.db.fetchone(theirs, (p.packet_id,)) == (2, 500)
    report = await reconcile(core)
    assert report.ok, report.differences


def test_the_tracing_bench_prints_the_hubs_path_beside_the_stock_sdk(redis_url: str) -> None:
    figures, _ = _bench(redis_url, "tracing")
    sides = ["hub_off", "hub_all", "stock_sdk_all", "hub_1pct", "stock_sdk_1pct"]
    assert all(float(figures[f"{side}_cpu_us_per_grab"]) > 0 for side in sides), figures  # type: ignore[arg-type]
    assert {"ratio_all", "ratio_1pct"} <= figures.keys()


async def test_more_bench_servers_than_the_default_pool_has_threads_start_and_stop() -> None:
    """A bench of more servers than the loop's default thread pool has threads (six on two cores): each
    server's output is read by a thread of its own, so none waits for a thread the others never give
    back (``bench hot --hubs 7`` waited for ever so)."""
    from bench import hubbench

    n = min(32, (os.cpu_count() or 1) + 4) + 1
    args = [sys.executable, "-c", "import signal; print('at http://127.0.0.1:9', flush=True); signal.pause()"]
    async with asyncio.timeout(120), AsyncExitStack() as stack:
        started = [
            await stack.enter_async_context(hubbench.server_process(args, dict(os.environ), r"at (\S+)"))
            for _ in range(n)
        ]
        assert [url for url, _ in started] == ["http://127.0.0.1:9"] * n
    for _, pid in started:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # stopped and reaped
