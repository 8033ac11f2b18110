"""The newcomer's command: ``redpacket up`` on the embedded default (Valkey + SQLite), used over HTTP."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from websockets.exceptions import ConnectionClosed

from redpacket_client.connection import HubClient, HubError
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


async def test_the_embedded_valkey_killed_during_grabs_is_started_again_and_every_won_is_paid(
    tmp_path: Path,
) -> None:
    """kill -9 of `up`'s own Valkey in the middle of a packet's grabs: `up` reaps it and starts it again
    on the same port and files (its AOF replayed: `aof` durability, every "won" was on disk), the hub and
    worker reconnect by themselves, grabs are answered "won" again, and every "won" is paid as told."""
    said: list[str] = []
    data = tmp_path / "data"
    with redpacket_up(data, said=said) as (url, _):
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            people = [(await http.post("/api/login", json={"name": f"p{i}"})).json() for i in range(13)]
            admin, members = people[0], people[1:]
            auth = {"authorization": f"Bearer {admin['token']}"}
            (
                await http.post("/api/topup", json={"amount": 5_000, "request_id": "t"}, headers=auth)
            ).raise_for_status()
            group = (await http.post("/api/groups", json={"name": "storm"}, headers=auth)).json()["group_id"]
            names = [m["name"] for m in members]
            (
                await http.post(f"/api/groups/{group}/members", json={"names": names}, headers=auth)
            ).raise_for_status()
        ws = url.replace("http://", "ws://") + "/ws"
        async with await HubClient.connect(ws, admin["token"]) as sender:
            sent = await sender.request("send", group=group, kind="lucky", total=1_200, count=12)
        told: dict[str, int] = {}
        for m in members[:6]:
            async with await HubClient.connect(ws, m["token"]) as c:
                told[m["token"]] = (await c.request("grab", group=group, packet=sent["packet_id"]))["amount"]
        before = json.loads((data / "valkey.json").read_text())
        valkey = redis.Redis.from_url(before["url"])
        # `up` set its server's options (a grab of a big packet scans a smaller hash).
        assert valkey.config_get("hash-max-listpack-entries") == {"hash-max-listpack-entries": "128"}
        valkey.set("test:written-before-the-kill", "1")  # (answered once fsynced: appendfsync always)
        killed = int(before["valkey_pid"])
        os.kill(killed, signal.SIGKILL)
        killed_at = time.monotonic()
        won_again_after = None
        for m in members[6:]:
            told[m["token"]] = await _grab_until_answered(ws, m["token"], group, sent["packet_id"])
            won_again_after = won_again_after or time.monotonic() - killed_at
        print(f"grabs answered won again {won_again_after:.1f} s after the kill")
        assert valkey.get("test:written-before-the-kill") == b"1"  # its AOF replayed
        # Started again with the same options.
        assert valkey.config_get("hash-max-listpack-entries") == {"hash-max-listpack-entries": "128"}
        valkey.close()
        # The supervisor writes valkey.json and its line once the new server answers (grabs may be
        # answered first), and `up`'s output is read by another thread: both waited for, bounded.
        deadline = time.monotonic() + 30
        while True:
            restarted = json.loads((data / "valkey.json").read_text())
            restarts = [
                line for line in said if "the embedded Valkey ended (signal 9); started again" in line
            ]
            if restarted["valkey_pid"] != killed and restarts:
                break
            assert time.monotonic() < deadline, (restarted, said[-20:])
            await asyncio.sleep(0.05)
        assert restarted["url"] == before["url"] and len(restarts) == 1  # same port and files; one line
        with pytest.raises(ProcessLookupError):
            os.kill(killed, 0)  # reaped, not left <defunct>
        # Every "won" is paid as told (the in-process worker credits them; a deadline bounds the wait).
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            deadline = time.monotonic() + 60
            for token, amount in told.items():
                me = {"authorization": f"Bearer {token}"}
                while (balance := (await http.get("/api/me", headers=me)).json()["balance"]) != amount:
                    if time.monotonic() >= deadline:  # what `up` said, to tell why
                        print("\n".join(said[-80:]))
                    assert time.monotonic() < deadline, (balance, amount)
                    await asyncio.sleep(0.1)
        assert sum(told.values()) == 1_200


async def _grab_until_answered(ws: str, token: str, group: int, packet: int) -> int:
    """A client grabbing as the protocol says: again while Redis is unavailable (reconnecting if the hub
    closed the socket), bounded."""
    deadline = time.monotonic() + 60
    while True:
        assert time.monotonic() < deadline, "no grab answered within 60 s"
        try:
            async with await HubClient.connect(ws, token) as c:
                return int((await c.request("grab", group=group, packet=packet))["amount"])
        except HubError as e:
            assert e.code == "redis_unavailable", e
        except (OSError, ConnectionClosed):
            pass
        await asyncio.sleep(0.1)
