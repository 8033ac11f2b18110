"""The newcomer's command: ``redpacket up`` on the embedded default (Valkey + SQLite), used over HTTP."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest


@pytest.fixture
def up(tmp_path: Path) -> Iterator[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REDPACKET_")}
    env["REDPACKET_DATA_DIR"] = str(tmp_path / "data")
    proc = subprocess.Popen(
        [sys.executable, "-m", "server", "up", "--port", "0"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    url = None
    seen = []
    deadline = time.monotonic() + 60
    while url is None and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        m = re.search(r"redpacket is up: (http://\S+)", line)
        url = m.group(1) if m else None
    assert url, "".join(seen)
    try:
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        proc.stdout.close()
    # The embedded Valkey kept its append-only file under the data directory.
    assert list((tmp_path / "data" / "valkey").rglob("*.aof*"))


def test_send_grab_credit_over_http_on_the_embedded_default(up: str) -> None:
    with httpx.Client(base_url=up, timeout=10) as http:
        assert http.get("/healthz").json() == {"ok": True}
        admin = http.post("/api/login", json={"name": "wang"}).json()["user_id"]
        li = http.post("/api/login", json={"name": "li"}).json()["user_id"]
        assert (
            http.post(f"/api/users/{admin}/topup", json={"amount": 5_000, "request_id": "t1"}).json()[
                "balance"
            ]
            == 5_000
        )
        group = http.post("/api/groups", json={"owner": admin, "name": "family"}).json()["group_id"]
        http.post(f"/api/groups/{group}/members", json={"user_ids": [li]}).raise_for_status()

        bad = http.post(f"/api/groups/{group}/packets", json={"sender": admin, "total": 0, "count": 1})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "amount_invalid"
        poor = http.post(f"/api/groups/{group}/packets", json={"sender": li, "total": 100, "count": 1})
        assert poor.status_code == 403 and poor.json()["error"]["code"] == "not_admin"

        sent = http.post(
            f"/api/groups/{group}/packets",
            json={"sender": admin, "kind": "lucky", "total": 888, "count": 2, "greeting": "新年快乐"},
        ).json()
        pid = sent["packet_id"]
        got = http.post(f"/api/groups/{group}/packets/{pid}/grab", json={"user": li}).json()
        assert got["outcome"] == "won" and 1 <= got["amount"] <= 887
        view = http.get(f"/api/groups/{group}/packets/{pid}", params={"user": li}).json()
        assert view["mine"]["amount"] == got["amount"] and view["remaining"] == 1

        # The in-process worker credits the grab; wait for it with a deadline.
        deadline = time.monotonic() + 15
        balance = 0
        while time.monotonic() < deadline:
            balance = http.get(f"/api/users/{li}/balance").json()["balance"]
            if balance:
                break
            time.sleep(0.05)
        assert balance == got["amount"]
        assert http.get(f"/api/users/{admin}/balance").json()["balance"] == 5_000 - 888
