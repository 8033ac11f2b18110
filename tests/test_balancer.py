"""The balancer of docker-compose.yml (deploy/haproxy.cfg), run with Debian's HAProxy in front of two
`redpacket serve` processes: its file is valid to the real binary, websockets pass, and a client whose
hub stops (close 1012) reconnects through it to the other hub."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest

from redpacket_client.connection import HubClient
from server.hub import protocol
from server.hub.tokens import make_token
from server.money import ledger
from server.settings import Settings
from server.store.engines import connect
from tests.hubtools import HubUnderTest, eventually, free_port, hub_process

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "deploy" / "haproxy.cfg"


def _haproxy() -> str:
    exe = shutil.which("haproxy") or (os.path.exists("/usr/sbin/haproxy") and "/usr/sbin/haproxy") or None
    if not exe:
        if os.environ.get("REDPACKET_TEST_REQUIRE_HAPROXY") == "1":
            pytest.fail("HAProxy is required (REDPACKET_TEST_REQUIRE_HAPROXY=1): apt-get install haproxy")
        pytest.skip("no HAProxy: apt-get install haproxy")
    return exe


def test_the_balancers_file_is_valid_to_haproxy() -> None:
    checked = subprocess.run(
        [_haproxy(), "-c", "-f", str(CONFIG)], capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def _here(port: int, hubs: list[HubUnderTest]) -> str:
    """The compose file's configuration on this machine: its port, and the hubs by address instead of by
    the compose service's DNS name (everything else as written)."""
    text = CONFIG.read_text().replace("bind :8000", f"bind 127.0.0.1:{port}")
    servers = "\n".join(
        f"    server hub{i} {h.http.removeprefix('http://')}" for i, h in enumerate(hubs, start=1)
    )
    template = next(line for line in text.splitlines() if line.strip().startswith("server-template hub"))
    assert "hub:8000" in template
    return text.replace(template, servers)


@asynccontextmanager
async def _balancer(tmp_path: Path, hubs: list[HubUnderTest]) -> AsyncIterator[str]:
    port = free_port()
    local = tmp_path / "haproxy.cfg"
    local.write_text(_here(port, hubs))
    with (tmp_path / "haproxy.log").open("w") as log:  # (the child keeps its own copy of the descriptor)
        proc = subprocess.Popen(  # noqa: ASYNC220 - one balancer per test
            [_haproxy(), "-db", "-f", str(local)], stdout=log, stderr=subprocess.STDOUT
        )
    try:
        url = f"http://127.0.0.1:{port}"

        async def answers() -> bool:
            try:
                async with httpx.AsyncClient(timeout=5) as http:
                    return (await http.get(f"{url}/healthz")).status_code == 200
            except httpx.TransportError:
                return False

        await eventually(answers, timeout=60)
        yield url
    finally:
        proc.terminate()
        await asyncio.to_thread(proc.wait, 30)
        said = (tmp_path / "haproxy.log").read_text()
        print("--- haproxy ---\n" + said[:3000] + "\n...\n" + said[-2000:])  # shown on failure


async def test_a_client_moves_to_the_other_hub_when_its_hub_stops(
    tmp_path: Path, hub_settings: Settings
) -> None:
    # Hubs as deployed: no dev login (a demo hub answers this machine only, never a proxy's requests),
    # and a small allowance of HTTP requests per client address.
    settings = hub_settings.replace(dev_login=False, demo_topup=False)
    limits = {
        "REDPACKET_HTTP_PER_ADDRESS_PER_SECOND": "0.001",
        "REDPACKET_HTTP_PER_ADDRESS_BURST": "5",
        "REDPACKET_TRUSTED_PROXIES": "127.0.0.1",  # the balancer, on this machine
    }
    db = await connect(settings.database_url)
    try:
        user = await ledger.create_user(db, "li")
    finally:
        await db.close()
    token = make_token(settings.secret.encode(), user, int(time.time()), 600)
    async with hub_process(settings, env=limits) as first, hub_process(settings, env=limits) as second:
        hubs = {first.http: first, second.http: second}
        ids = {}
        for h in hubs.values():  # each hub's id, as its welcome says it
            c = await HubClient.connect(h.ws, token)
            ids[c.welcome["hub"]] = h
            await c.close()
        async with _balancer(tmp_path, list(hubs.values())) as lb:
            ws = lb.replace("http://", "ws://") + "/ws"
            client = await HubClient.connect(ws, token)
            served_by = ids[client.welcome["hub"]]
            assert (await client.request("ping"))["ts"] > 0  # frames pass both ways
            assert served_by.process is not None
            served_by.process.terminate()  # the hub drains: its sockets closed with 1012
            await eventually(lambda: client.closed is not None, timeout=60)
            assert client.closed is not None and client.closed.rcvd is not None
            assert client.closed.rcvd.code == protocol.CLOSE_RESTART
            again = await HubClient.connect(ws, token)  # as a client does on 1012: reconnect at once
            assert ids[again.welcome["hub"]] is not served_by
            assert (await again.request("ping"))["ts"] > 0
            await again.close()
            # A client cannot pass for another address: the balancer drops the X-Forwarded-For it wrote,
            # so the hub's per-address allowance (5) runs out whatever it claims to be.
            auth = {"authorization": f"Bearer {token}"}
            async with httpx.AsyncClient(base_url=lb, timeout=10) as http:
                codes = [
                    (
                        await http.get("/api/me", headers={**auth, "x-forwarded-for": f"203.0.113.{i}"})
                    ).status_code
                    for i in range(8)
                ]
            assert codes.count(429) >= 3, codes
