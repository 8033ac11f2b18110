"""The newcomer's command: ``redpacket up`` on the embedded default (Valkey + SQLite), used over HTTP."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from server.tools.client import HubClient, HubError
from tests.hubtools import redpacket_up


@pytest.fixture
def up(tmp_path: Path) -> Iterator[str]:
    with redpacket_up(tmp_path / "data") as (url, proc):
        yield url
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    # The embedded Valkey kept its append-only file under the data directory.
    assert list((tmp_path / "data" / "valkey").rglob("*.aof*"))


async def test_send_grab_credit_on_the_embedded_default(up: str) -> None:
    async with httpx.AsyncClient(base_url=up, timeout=10) as http:
        assert (await http.get("/healthz")).json() == {"ok": True}
        wang = (await http.post("/api/login", json={"name": "wang"})).json()
        li = (await http.post("/api/login", json={"name": "li"})).json()
        auth = {"authorization": f"Bearer {wang['token']}"}
        assert (
            await http.post("/api/topup", json={"amount": 5_000, "request_id": "t1"}, headers=auth)
        ).json()["balance"] == 5_000
        group = (await http.post("/api/groups", json={"name": "family"}, headers=auth)).json()["group_id"]
        (
            await http.post(f"/api/groups/{group}/members", json={"names": ["li"]}, headers=auth)
        ).raise_for_status()

    ws = up.replace("http://", "ws://") + "/ws"
    async with (
        await HubClient.connect(ws, wang["token"], "json") as admin,
        await HubClient.connect(ws, li["token"]) as member,
    ):
        await admin.sync()
        await member.sync()
        with pytest.raises(HubError) as e:
            await admin.request("send", group=group, total=0, count=1)
        assert e.value.code == "amount_invalid"
        sent = await admin.request("send", group=group, kind="lucky", total=888, count=2, greeting="新年快乐")
        got = await member.request("grab", group=group, packet=sent["packet_id"])
        assert got["outcome"] == "won" and 1 <= got["amount"] <= 887

    # The in-process worker credits the grab; wait for it with a deadline.
    async with httpx.AsyncClient(base_url=up, timeout=10) as http:
        me = {"authorization": f"Bearer {li['token']}"}
        deadline = time.monotonic() + 15
        balance = 0
        while time.monotonic() < deadline and balance == 0:
            balance = (await http.get("/api/me", headers=me)).json()["balance"]
        assert balance == got["amount"]
        assert (await http.get("/api/me", headers=auth)).json()["balance"] == 5_000 - 888
