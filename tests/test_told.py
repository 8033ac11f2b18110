"""What the hub tells whom, against a real hub: a non-member learns nothing of a packet (not even that it
exists), an unknown request type is not echoed back whole, and a client that left before its welcome
costs the log no traceback."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
import msgpack
import pytest
import websockets

from server.money import groups, packets
from server.settings import Settings
from tests.hubtools import HubUnderTest, eventually, hub_in_process
from tests.repofiles import says


async def _get(h: HubUnderTest, path: str, token: str) -> tuple[int, Any]:
    async with httpx.AsyncClient(base_url=h.http, timeout=30) as http:
        r = await http.get(path, headers={"authorization": f"Bearer {token}"})
    return r.status_code, r.json()


async def test_a_non_member_is_answered_as_for_an_unknown_packet(h: HubUnderTest) -> None:
    """Before: 403 `not_member` naming the packet's group, where an unknown id is 404."""
    admin, admin_token = await h.login("wang")
    await h.api("POST", "/api/topup", admin_token, amount=10_000, request_id="seed")
    _, stranger = await h.login("zhao")
    group = await groups.create_group(h.core.db, admin, "family")
    sent = await packets.send_packet(
        h.core, sender_id=admin, group_id=group, kind="lucky", total=300, count=1
    )
    member = await _get(h, f"/api/packets/{sent.packet_id}", admin_token)
    assert member[0] == 200 and member[1]["packet_id"] == sent.packet_id
    hidden = await _get(h, f"/api/packets/{sent.packet_id}", stranger)
    unknown = await _get(h, f"/api/packets/{sent.packet_id + 1000}", stranger)
    # The same answer, but for the id each request is given (to trace it in the log).
    for answer in (hidden, unknown):
        answer[1]["error"].pop("request_id", None)
    assert hidden == unknown == (404, {"error": {"code": "packet_not_found", "message": "no such packet"}})


async def test_an_unknown_type_is_quoted_in_at_most_64_characters(h: HubUnderTest) -> None:
    """Before: a 60 KB `type` came back whole in the error's message (240 KB of escapes)."""
    says("Its message quotes the `type` sent in at most 64 characters, followed by `… (truncated)`")
    _, token = await h.login("li")
    async with websockets.connect(f"{h.ws}?token={token}", max_size=2**20) as raw:
        assert msgpack.unpackb(await asyncio.wait_for(raw.recv(), 10))["type"] == "welcome"
        for kind, shown in (
            ("dance", "unknown request type 'dance'"),
            ("\x00" * 60_000, "unknown request type '" + "\\x00" * 15 + "\\x0… (truncated)"),
            (["x" * 60_000], "unknown request type ['xxxxxxxxxxxx...xxxxxxxxxxxxx']"),
        ):
            await raw.send(msgpack.packb({"id": 1, "type": kind}))
            frame = await asyncio.wait_for(raw.recv(), 10)
            reply = msgpack.unpackb(frame)
            assert reply["error"] == {"code": "unknown_type", "message": shown}
            assert len(frame) < 200


async def test_a_client_gone_before_its_welcome_timed_out_costs_one_line_at_most(
    hub_settings: Settings, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The welcome waits on the database past its bound; the client has already left: no traceback,
    no warning, at most one line."""
    caplog.set_level(logging.INFO, logger="server")
    async with hub_in_process(hub_settings.replace(handshake_seconds=0.5)) as h:
        _, token = await h.login("li")
        asking = asyncio.Event()

        async def stalled(*args: object, **kwargs: object) -> dict[object, object]:
            asking.set()
            await asyncio.Event().wait()  # a database that does not answer (the welcome's bound gives up)
            return {}

        monkeypatch.setattr(groups, "groups_of_many", stalled)  # (the welcome reads through it)
        for leave in ("abort", "close"):
            caplog.clear()
            asking.clear()
            raw = await websockets.connect(f"{h.ws}?token={token}")
            await asyncio.wait_for(asking.wait(), 10)
            if leave == "abort":
                raw.transport.abort()
            else:
                await raw.close()
            await eventually(lambda: "before its welcome" in caplog.text, timeout=10)
            about = [r for r in caplog.records if r.name.startswith(("server", "uvicorn", "asyncio"))]
            assert len(about) == 1, caplog.text
            assert about[0].levelno <= logging.INFO and not about[0].exc_info, caplog.text
