"""``redpacket load``: a short step-up run of Locust against a real ``redpacket up`` (hub + worker). (The
pure arithmetic of the plan and the report: ``tests/unit/test_load.py``.)"""

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

from server.settings import child_env
from tests.hubtools import redpacket_up


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
