"""``redpacket load``: a short step-up run of Locust against a real ``redpacket up`` (hub + worker), and
the pure arithmetic of the plan and the report."""

from __future__ import annotations

import csv
import json
import re
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from bench.loadplan import (
    StageFigures,
    bucket_quantile,
    knee,
    parse_stages,
    percentile,
    stage_at,
    subtract,
)
from server.settings import child_env
from tests.hubtools import redpacket_up


@pytest.mark.unit
def test_stages_parse_to_end_times_and_refuse_nonsense() -> None:
    stages = parse_stages("10:5, 20:2.5,40:10")
    assert [(s.users, s.ends_at) for s in stages] == [(10, 5.0), (20, 7.5), (40, 17.5)]
    assert [stage_at(stages, t) for t in (0, 4.9, 5, 17.4, 17.5)] == [0, 0, 1, 2, None]
    for bad in ("", "10", "10:0", "0:5", "a:5", "10:-1", "10:nan"):
        with pytest.raises(ValueError):
            parse_stages(bad)


@pytest.mark.unit
def test_percentiles_of_counts_and_of_prometheus_buckets() -> None:
    counts = {5: 50, 10: 40, 200: 10}
    assert percentile(counts, 0.5) == 5
    assert percentile(counts, 0.9) == 10
    assert percentile(counts, 0.99) == 200
    assert percentile({}, 0.99) == 0
    assert subtract({5: 60, 10: 40}, {5: 50, 10: 40}) == {5: 10}
    # 100 samples: 90 at or below 0.1, all 100 at or below 1.0 → P99 interpolated in (0.1, 1.0].
    q = bucket_quantile([(0.1, 90), (1.0, 100), (float("inf"), 100)], 0.99)
    assert q is not None and abs(q - 0.91) < 1e-9
    assert bucket_quantile([(0.1, 0), (float("inf"), 0)], 0.99) is None
    assert bucket_quantile([(0.1, 5), (float("inf"), 10)], 0.99) == 0.1  # beyond the last bound


def _stage(
    users: int, grabs: int, p99: float, failures: int = 0, offered: int = 0, sends: int = 0
) -> StageFigures:
    return StageFigures(
        users=users,
        seconds=10,
        requests=grabs + 100,
        failures=failures,
        grabs=grabs,
        grab_p99_ms=p99,
        offered=offered,
        sends=sends,
    )


@pytest.mark.unit
def test_the_knee_is_where_p99_errors_or_throughput_turn() -> None:
    assert knee([_stage(100, 1000, 20), _stage(200, 2000, 25), _stage(400, 4000, 30)])[0] is None
    assert knee([_stage(100, 1000, 60), _stage(200, 2000, 130)])[0] == 1  # P99 over 2× and over 100 ms
    assert knee([_stage(100, 1000, 20), _stage(200, 2000, 90)])[0] is None  # 4.5× but under the floor
    assert knee([_stage(100, 1000, 20), _stage(200, 2000, 25, failures=50)])[0] == 1  # 2.3% errors
    assert knee([_stage(100, 1000, 20), _stage(200, 1050, 25)])[0] == 1  # throughput flat
    assert knee([])[0] is None


@pytest.mark.unit
def test_flat_throughput_is_the_loads_limit_when_the_load_offered_no_more() -> None:
    """Before: "grabs/s 28 did not grow with the users (200 → 300)" at 14 % hub CPU, when three admins
    sending every 10 s offered no more grabs."""
    at, why = knee([_stage(200, 280, 20, offered=285), _stage(300, 290, 22, offered=295)])
    assert at is None and "the load was the limit from 300 users" in why and "--send-every" in why, why
    at, why = knee([_stage(200, 280, 20, offered=285), _stage(300, 290, 22, offered=600)])
    assert at == 1 and "while the grabs offered did (28 → 60/s)" in why, why
    # Offered flat while the admins sent more: the packets were not delivered — the system's knee.
    flat_but_sent = [_stage(200, 280, 20, offered=285, sends=20), _stage(300, 290, 22, offered=290, sends=30)]
    assert knee(flat_but_sent)[0] == 1


def test_a_step_up_run_against_a_hub_and_worker(tmp_path: Path) -> None:
    out = tmp_path / "out"
    fixture = tmp_path / "fixture.json"
    with redpacket_up(tmp_path / "data") as (url, _):
        # The users and groups made once (as for a distributed run), then the run on them.
        made = subprocess.run(
            [
                *(sys.executable, "-m", "server", "load", "--host", url),
                *("--stages", "8:8,16:8", "--group-size", "8", "--prepare", str(fixture)),
            ],
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert made.returncode == 0, made.stdout + made.stderr
        data = json.loads(fixture.read_text())
        assert len(data["groups"]) == 2 and len(data["users"]) == 16 + 2
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "server",
                "load",
                "--host",
                url,
                "--fixture",
                str(fixture),
                "--stages",
                "8:8,16:8",
                "--send-every",
                "2",
                "--reaction-ms",
                "300",
                "--headless",
                "--html",
                str(out / "report.html"),
                "--csv",
                str(out / "report"),
                "--report",
                str(out / "stages.json"),
                "--plot",
                str(out / "plots"),
            ],
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        said = run.stdout + run.stderr
        assert run.returncode == 0, said[-5000:]

        with (out / "report_stats.csv").open() as f:
            rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(f)}
        assert int(rows[("grab", "won")]["Request Count"]) > 0, said[-3000:]
        # Every reply, those in flight at the stop included (Locust's CSV is written once a second).
        totals = json.loads((out / "stages.json").read_text())["totals"]
        won = totals["grab won"]["requests"]
        assert won >= int(rows[("grab", "won")]["Request Count"])
        assert sum(t["failures"] for t in totals.values()) == 0
        assert int(rows[("connect", "ws")]["Request Count"]) >= 16
        assert int(rows[("", "Aggregated")]["Failure Count"]) == 0
        assert ("grab", "already") not in rows  # each member grabs each packet once
        html = (out / "report.html").read_text()
        assert "grab" in html and "connect" in html and "redpacket-server-side" in html

        report = json.loads((out / "stages.json").read_text())
        assert [s["users"] for s in report["stages"]] == [8, 16]
        assert sum(s["won"] for s in report["stages"]) <= won
        # What the load offered (packets the members saw) and the admins' sends are counted per stage.
        assert all(s["offered"] > 0 and s["sends"] > 0 for s in report["stages"]), report["stages"]
        assert report["stages"][-1]["server"]["connections"] >= 1
        summary = json.loads(run.stdout.strip().splitlines()[-1])
        assert len(summary["load"]) == 2
        for png in ("load-stages.png", "load-server.png"):
            assert (out / "plots" / png).stat().st_size > 5_000

        # Every grab a client was told it won reaches the ledger, and the books balance.
        # The hub's own count of the "won" it answered: the clients heard each one.
        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as page:
            told = re.search(r'redpacket_grab_outcomes_total\{outcome="won"\} (\S+)', page.read().decode())
        assert told is not None and int(float(told[1])) == won
        db = sqlite3.connect(tmp_path / "data" / "redpacket.sqlite3")
        deadline = time.monotonic() + 60
        while db.execute("SELECT COUNT(*) FROM grab_records").fetchone()[0] < won:
            assert time.monotonic() < deadline, "credits did not all arrive"
            time.sleep(0.1)
        # Exactly the grabs the clients were told they won (a grab sent before the stop gets its reply).
        recorded, credited = db.execute(
            "SELECT COUNT(*), SUM(status = 'credited') FROM grab_records"
        ).fetchone()
        assert recorded == won
        while credited < recorded:
            assert time.monotonic() < deadline, "credits did not all arrive"
            time.sleep(0.1)
            credited = db.execute("SELECT SUM(status = 'credited') FROM grab_records").fetchone()[0]
        db.close()
        reconciled = subprocess.run(
            [sys.executable, "-m", "server", "reconcile"],
            env=child_env(REDPACKET_DATA_DIR=str(tmp_path / "data")),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert reconciled.returncode == 0, reconciled.stdout + reconciled.stderr
        assert "no difference" in reconciled.stdout


@pytest.mark.unit
def test_server_frames_are_parsed_whole_and_partial_ones_left_for_later() -> None:
    from bench.loadplan import server_frames

    small = bytes([0x82, 3]) + b"abc"
    mid = bytes([0x82, 126]) + (300).to_bytes(2, "big") + b"x" * 300
    big = bytes([0x82, 127]) + (70_000).to_bytes(8, "big") + b"y" * 70_000
    ping = bytes([0x89, 0])
    stream = small + mid + big + ping
    assert server_frames(stream) == (
        [(2, b"abc"), (2, b"x" * 300), (2, b"y" * 70_000), (9, b"")],
        len(stream),
    )
    for cut in (1, 3, 6, len(small) + 3, len(small) + len(mid) + 9, len(stream) - 1):
        frames, used = server_frames(stream[:cut])
        rest, more = server_frames(stream[used:])
        assert frames + rest == server_frames(stream)[0] and used + more == len(stream)


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--host", "http://127.0.0.1:1", "--headless"], "cannot reach the hub at http://127.0.0.1:1"),
        (["--stages", "10:x"], "stage '10:x' is not users:seconds"),
        (["--worker"], "a Locust worker (--worker) needs --fixture FILE"),
        (["--fixture", "FIXTURE", "--headless"], "is not a load fixture (no users)"),
        (["--group-size", "1"], "--group-size must be at least 2"),
    ],
)
def test_operator_mistakes_are_one_line_and_exit_2(args: list[str], said: str, tmp_path: Path) -> None:
    bad = tmp_path / "fixture.json"
    bad.write_text('{"users": []}')
    done = subprocess.run(
        [sys.executable, "-m", "server", "load", *[str(bad) if a == "FIXTURE" else a for a in args]],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("redpacket: ") and said in lines[0], done.stderr
