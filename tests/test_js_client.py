"""The JavaScript client (``clients/js``) against a live hub: its own tests, in node's built-in runner.

A real hub (uvicorn in this process, the credit worker beside it, real Redis and MariaDB) with users, a
group and money made over the HTTP API; then the package's ``npm test`` command (``node --test``) runs
``clients/js/test/`` with the hub's address and the users' tokens in its environment. A control port lets
those tests make the hub act on its side: close a user's sockets with a close code (a real server-side
close: the client sees the hub's code), or send a ``gap`` notice. Every user, group and packet id is beyond
2^53 (the database's counters start near 2^63), where a JavaScript number would not hold it exactly: the
client must carry each as the string protocol version 2 makes it. Without Node.js 20 or later (its
WebSocket) the test skips and says why, unless REDPACKET_TEST_REQUIRE_NODE=1 (CI sets it): then it fails."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from server.hub import protocol
from server.hub.tokens import make_token
from server.ids import GroupId, UserId
from server.settings import Settings
from tests.hubtools import HubUnderTest, hub_in_process

CLIENT_DIR = Path(__file__).resolve().parent.parent / "clients" / "js"
REQUIRED = os.environ.get("REDPACKET_TEST_REQUIRE_NODE") == "1"


def node_20() -> str:
    """The ``node`` to run (20 or later: the client's tests use its WebSocket), or the test skips."""
    node = shutil.which("node")
    version = subprocess.run([node, "--version"], capture_output=True, text=True).stdout if node else ""
    m = re.match(r"v(\d+)\.", version)
    if node is None or m is None or int(m.group(1)) < 20:
        why = f"Node.js 20 or later is needed (found {version.strip() or 'none'}): apt-get install nodejs"
        if REQUIRED:
            pytest.fail(f"{why} (REDPACKET_TEST_REQUIRE_NODE=1)")
        pytest.skip(why)
    return node


async def _control(hub: HubUnderTest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """One command a line: ``drop USER CODE`` closes every socket of USER on the hub with CODE;
    ``gap USER GROUP`` sends USER's sockets a ``gap`` notice for GROUP. Answers ``ok N`` (sockets)."""
    while line := await reader.readline():
        what, user, arg = line.decode().split()
        conns = list(hub.hub.by_user.get(UserId(int(user)), ()))
        for conn in conns:
            if what == "drop":
                conn.close(int(arg), "closed by the test")
            else:
                conn.send({"type": "gap", "group": GroupId(int(arg))})
        writer.write(f"ok {len(conns)}\n".encode())
        await writer.drain()
    writer.close()


async def test_the_javascript_client_passes_its_node_tests_against_a_live_hub(
    hub_settings: Settings, big_ids: int
) -> None:
    node = node_20()
    # A few sockets per user: the client's test of a refused socket (4030) opens one too many.
    async with hub_in_process(hub_settings.replace(max_sockets_per_user=3), run_worker=True) as hub:
        alice, alice_token = await hub.login("alice")
        bob, bob_token = await hub.login("bob")
        carol, carol_token = await hub.login("carol")
        await hub.api("POST", "/api/topup", alice_token, amount=100_000, request_id="js-topup")
        group = (await hub.api("POST", "/api/groups", alice_token, name="js"))["group_id"]
        assert min(alice, bob, carol, group) >= big_ids > 2**53, "the ids are not the big ones"
        await hub.api("POST", f"/api/groups/{group}/members", alice_token, user_ids=[bob, carol])
        now = int(time.time())
        expired = make_token(hub.settings.secret.encode(), bob, now - 7200, 3600)

        control = await asyncio.start_server(lambda r, w: _control(hub, r, w), "127.0.0.1", 0)
        script = json.loads((CLIENT_DIR / "package.json").read_text())["scripts"]["test"]
        env = {
            "PATH": str(Path(node).parent) + ":/usr/bin:/bin",
            "RP_WS": hub.ws,
            "RP_HTTP": hub.http,
            "RP_CONTROL_PORT": str(control.sockets[0].getsockname()[1]),
            "RP_GROUP": str(group),
            "RP_ALICE": str(alice),
            "RP_ALICE_TOKEN": alice_token,
            "RP_BOB": str(bob),
            "RP_BOB_TOKEN": bob_token,
            "RP_BOB_EXPIRED_TOKEN": expired,
            "RP_CAROL": str(carol),
            "RP_CAROL_TOKEN": carol_token,
            "RP_CLOSE_RESTARTING": str(protocol.CLOSE_RESTART),
        }
        try:
            proc = await asyncio.create_subprocess_exec(
                "sh", "-c", script, cwd=CLIENT_DIR, env=env,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            )  # fmt: skip
            out, _ = await asyncio.wait_for(proc.communicate(), 180)
        finally:
            control.close()
            await control.wait_closed()
    report = out.decode()
    print(report)  # shown when the test fails: node's TAP report
    assert proc.returncode == 0, report[-8000:]
    counts = {k: int(v) for k, v in re.findall(r"^# (tests|pass|fail|skipped) (\d+)$", report, re.M)}
    assert (
        counts["fail"] == counts["skipped"] == 0
        and counts["tests"] >= 10
        and counts["pass"] == counts["tests"]
    ), counts
