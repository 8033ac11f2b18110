"""docs/integration.md as an integrator follows it: every marked example, run as written against a real
``redpacket up`` with a secret and a service key, then the RS256 example against the same data with the
public key it made."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.hubtools import redpacket_up
from tests.repofiles import ROOT, guide_example


def replies(output: str) -> list[dict[str, Any]]:
    """The JSON objects curl printed one after another (without newlines between them)."""
    found, at, decoder = [], 0, json.JSONDecoder()
    while (at := output.find("{", at)) != -1:
        value, at = decoder.raw_decode(output, at)
        found.append(value)
    return found


@pytest.mark.skipif(
    shutil.which("curl") is None or shutil.which("openssl") is None, reason="uses curl and openssl"
)
def test_the_integration_guide_runs_as_written(tmp_path: Path) -> None:
    env = {"REDPACKET_SECRET": secrets.token_hex(32), "REDPACKET_SERVICE_KEY": secrets.token_hex(32)}

    def run(marker: str, url: str) -> str:
        shell_env = {**os.environ, **env, "H": url}
        if marker.endswith(("token", "rs256", "python-client")):
            script = tmp_path / f"{marker}.py"
            script.write_text(guide_example(marker))
            command = [sys.executable, str(script)]
        elif marker.endswith("js-client"):
            # As `npm install <checkout>/clients/js` leaves it: the package under node_modules.
            package = tmp_path / "node_modules" / "@redpacket" / "client"
            if not package.exists():
                package.parent.mkdir(parents=True)
                package.symlink_to(ROOT / "clients" / "js", target_is_directory=True)
            (tmp_path / "zhao.mjs").write_text(guide_example(marker))
            command = ["node", "--experimental-websocket", "zhao.mjs"]
        else:
            command = ["bash", "-euo", "pipefail", "-c", guide_example(marker)]
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=shell_env
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    with redpacket_up(tmp_path / "data", env=env) as (url, _):
        assert [r["result"] for r in replies(run("integration-users", url))] == ["created"] * 3
        put, late, removed, added = replies(run("integration-groups", url))
        assert (put["applied"], put["added"], late["applied"]) == (True, [1001, 1002, 1003], False)
        assert (removed["removed"], added["role"]) == (True, "member")
        assert run("integration-token", url) == "li ['family']\n"
        paid, again = replies(run("integration-money", url))
        assert (paid["replay"], again["replay"], again["balance"]) == (False, True, 8800)
        out, again, held, confirmed, held2, released = replies(run("integration-payout", url))
        assert (out["replay"], out["balance"], again["replay"], again["balance"]) == (False, 7800, True, 7800)
        assert (held["state"], held["balance"], confirmed["state"], confirmed["balance"]) == (
            "held",
            5800,
            "confirmed",
            5800,
        )
        assert (held2["balance"], released["state"], released["balance"]) == (5300, "released", 5800)
        account, journal = replies(run("integration-reconcile", url))
        assert account == {"user_id": 1001, "balance": 5800, "journal_sum": 5800}
        assert [(e["key"], e["amount"]) for e in journal["entries"]] == [
            ("service-topup:wallet-tx-77", 8800),
            ("withdraw:out-1", -1000),
            ("hold:bank-9", -2000),
            ("hold:bank-10", -500),
            ("release:bank-10", 500),
        ]
        (pulled,) = replies(run("integration-events", url))
        assert [e["type"] for e in pulled["events"]] == [
            "account.topup",
            "account.withdrawn",
            "hold.created",
            "hold.confirmed",
            "hold.created",
            "hold.released",
        ]
        assert pulled["more"] is False and pulled["next"] == pulled["events"][-1]["id"]
        assert run("integration-python-client", url) == (
            "won a share of 300 cents; 2 left\n"
            "not revealed yet: the seed is shown once the packet is finished or refunded\n"
        )
        if shutil.which("node") or os.environ.get("REDPACKET_TEST_REQUIRE_NODE") == "1":
            assert run("integration-js-client", url) == "zhao won 100 cents; 2 left\n"
        run("integration-keys", url)

    # The same data, now a hub that takes the backend's RS256 tokens and no HS256 ones.
    rs_env = {**env, "REDPACKET_JWT_PUBLIC_KEY": str(tmp_path / "backend-public.pem")}
    with redpacket_up(tmp_path / "data", env=rs_env) as (url, _):
        assert run("integration-rs256", url) == "200\n"
        hs = subprocess.run(
            [sys.executable, str(tmp_path / "integration-token.py")],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, **env, "H": url},
        )
        assert hs.returncode != 0 and "401" in hs.stderr  # the HS256 token of step 3 is refused here
