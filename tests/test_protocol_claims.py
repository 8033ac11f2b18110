"""Claims of docs/protocol.md, each quoted from the document and checked against a running hub: a test
fails when the hub stops doing what the words say, or the words change without the test."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from redpacket_client.connection import HubClient, HubError
from server.money import groups
from server.settings import Settings
from tests.hubtools import HubUnderTest, eventually, hub_in_process
from tests.repofiles import says


async def test_events_held_before_a_sync_from_null_are_delivered_before_its_reply(h: HubUnderTest) -> None:
    """Before: a chat sent while the socket was unsynced was never delivered when it then synced null."""
    says(
        "Held events are delivered before the sync's reply, whatever offset you sync from (`null` included:"
        " nothing that happened between the welcome and the sync is lost)"
    )
    admin, admin_token = await h.login("wang")
    member, member_token = await h.login("li")
    group = await groups.create_group(h.core.db, admin, "family")
    await groups.add_members(h.core.db, h.core.membership, group, [member])
    li = await h.client(member_token, sync=False)
    wang = await h.client(admin_token)
    try:
        chat = await wang.request("chat", group=group, text="while li was not synced")
        # The chat has reached li's socket on the hub (held there, li being unsynced) before li syncs.
        await eventually(lambda: any(c.holding(group) for c in h.hub.by_user.get(member, ())))
        reply = await li.request("sync", groups={str(group): None})
        assert reply["groups"][str(group)]["offset"] >= chat["offset"]
        heard = [e async for e in _events_now(li) if e["event"] == "chat"]
        assert [e["data"]["text"] for e in heard] == ["while li was not synced"]
        assert heard[0]["offset"] == chat["offset"]
    finally:
        await li.close()
        await wang.close()


async def _events_now(c: object) -> AsyncIterator[dict[str, object]]:
    """The events already received (the reply came after them: nothing to wait for)."""
    from redpacket_client.connection import HubClient

    assert isinstance(c, HubClient)
    while not c.events.empty():
        yield c.events.get_nowait()


async def test_a_request_that_is_not_http_gets_the_apis_json_error(h: HubUnderTest) -> None:
    """Before: uvicorn's plain-text `Invalid HTTP request received.`"""
    says(
        "a request that cannot be parsed (a header line without a colon, say) is answered `400`"
        " (`bad_request`)"
    )
    says("These answers carry the HTTP API's JSON error.")
    host, port = h.http.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"GET /ws HTTP/1.1\r\nHost: 127.0.0.1\r\nno colon here\r\n\r\n")
    answer = await asyncio.wait_for(reader.read(), 15)
    writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ")
    assert json.loads(body)["error"]["code"] == "bad_request"


async def test_the_rate_limit_answers_then_closes_after_the_burst_plus_one(hub_settings: Settings) -> None:
    """Before: the 41st refused message closed the socket without an answer, while the document said each
    request gets exactly one reply."""
    says("the connection is closed with 4029 right after the answer to the (`REDPACKET_MSGS_BURST` + 1)th")
    says("Every request gets **exactly one reply** with the same `id` (requests sent after the hub closed")
    async with hub_in_process(hub_settings.replace(msgs_per_second=0.001, msgs_burst=3)) as hub:
        _, token = await hub.login("flood")
        c = await hub.client(token, sync=False)
        for i in range(10):
            await c.send_raw(c.encode({"id": i, "type": "ping"}))
        await eventually(lambda: c.closed is not None or c.ws.close_code is not None)
        replies = []
        while not c.notices.empty():
            note = c.notices.get_nowait()
            if note["type"] == "reply":
                replies.append((note["id"], note["ok"] or note["error"]["code"]))
        assert replies == [(0, True), (1, True), (2, True)] + [(i, "rate_limited") for i in range(3, 7)]
        assert c.ws.close_code == 4029
        await c.close()


async def test_envelope_and_packet_codes_the_document_names(h: HubUnderTest) -> None:
    says("an integer from −2⁶³ to 2⁶⁴−1 (signed or unsigned 64-bit) or a string of at most 64 characters")
    says("A missing or unknown `type` is answered `unknown_type`.")
    says("a `request_id` that is empty, over 64 characters")
    says("`exclusive`: 1, may be left out — any other count is `count_invalid`")
    admin, token = await h.login("wang")
    member, _ = await h.login("li")
    group = await groups.create_group(h.core.db, admin, "family")
    await groups.add_members(h.core.db, h.core.membership, group, [member])
    c = await h.client(token)
    try:
        for rid in (2**64 - 1, -(2**63), "x" * 64):
            await c.send_raw(c.encode({"id": rid, "type": "ping"}))
            note = await _next_reply(c)
            assert (note["id"], note["ok"]) == (rid, True)
        await c.send_raw(json.dumps({"id": 2**64, "type": "ping"}))  # (msgpack has no such integer)
        note = await _next_reply(c)
        assert (note["id"], note["error"]["code"]) == (None, "bad_request")
        await c.send_raw(c.encode({"id": 7}))
        assert (await _next_reply(c))["error"]["code"] == "unknown_type"
        for fields, code in (
            ({"kind": "exclusive", "count": 2, "target": member}, "count_invalid"),
            ({"request_id": ""}, "bad_request"),
            ({"request_id": "r" * 65}, "bad_request"),
        ):
            with pytest.raises(HubError) as refused:
                await c.request("send", group=group, total=100, **{"count": 1, **fields})
            assert refused.value.code == code, fields
    finally:
        await c.close()


async def _next_reply(c: HubClient) -> dict[str, Any]:
    while (note := await c.next_notice(timeout=30))["type"] != "reply":
        pass
    return note


async def test_an_offset_past_the_newest_event_is_too_old(h: HubUnderTest) -> None:
    """Before: `replayed: 0` for a group with events, `too_old` for one without."""
    says(
        "or your offset is past the group's newest event (an offset from before Redis lost the group's"
        " events)"
    )
    admin, token = await h.login("wang")
    quiet = await groups.create_group(h.core.db, admin, "quiet")
    busy = await groups.create_group(h.core.db, admin, "busy")
    c = await h.client(token)
    try:
        latest = (await c.request("chat", group=busy, text="hello"))["offset"]
        ahead = f"{int(latest.split('-')[0]) + 60_000}-0"
        synced = await c.request("sync", groups={str(quiet): ahead, str(busy): ahead})
        assert synced["groups"][str(quiet)]["too_old"] is True
        assert synced["groups"][str(busy)]["too_old"] is True
        assert synced["groups"][str(busy)]["offset"] == latest
    finally:
        await c.close()
