"""The websocket hub, in this process: protocol, auth, recovery, presence, protection."""

from __future__ import annotations

import asyncio
import re
import time
import urllib.parse
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
import websockets
from websockets.exceptions import ConnectionClosed

from redpacket_client.connection import HubClient, HubError
from redpacket_client.protocol import offset_key
from server.core import open_core
from server.hub import packetcache, protocol
from server.hub.tokens import make_token
from server.live import bots
from server.live.botscore import Attempt
from server.money.ledger import now_ms
from server.settings import Settings
from server.store import keys
from tests.conftest import block
from tests.hubtools import HubUnderTest, events_of, eventually, hub_in_process, make_room
from tests.redisproc import needs_redis_server, redis_process
from tests.repofiles import ROOT


async def test_send_grab_open_over_the_socket_in_both_formats(h: HubUnderTest) -> None:
    room = await make_room(h, 2)
    admin = await h.client(room.admin_token, "json")
    member = await h.client(room.members[0][1], "msgpack")
    assert room.group in admin.groups and room.group in member.groups
    sent = await admin.request("send", group=room.group, kind="lucky", total=1_000, count=2, greeting="恭喜")
    ev = (await events_of(member, 1, "packet"))[0]
    assert ev["data"]["packet_id"] == sent["packet_id"] and ev["data"]["greeting"] == "恭喜"  # type: ignore[index]
    got = await member.request("grab", group=room.group, packet=sent["packet_id"])
    assert got["outcome"] == "won" and got["remaining"] == 1
    again = await member.request("grab", group=room.group, packet=sent["packet_id"])
    assert again["outcome"] == "already" and again["amount"] == got["amount"]
    grabs = (await events_of(admin, 1, "grabs"))[0]
    assert grabs["data"]["grabs"][0]["user"] == room.members[0][0]  # type: ignore[index]
    view = await member.request("open", group=room.group, packet=sent["packet_id"])
    assert view["mine"]["amount"] == got["amount"] and view["remaining"] == 1
    other = await h.client(room.members[1][1])
    await other.request("grab", group=room.group, packet=sent["packet_id"])
    fin = (await events_of(member, 1, "finished"))[0]
    assert fin["data"]["best_luck"]["amount"] == max(got["amount"], 1_000 - got["amount"])  # type: ignore[index]
    detail = await h.api("GET", f"/api/packets/{sent['packet_id']}", room.admin_token)
    assert sum(g["amount"] for g in detail["grabs"]) == 1_000
    for c in (admin, member, other):
        await c.close()


async def test_chat_and_a_failed_grab_is_not_announced(h: HubUnderTest) -> None:
    room = await make_room(h, 2)
    a = await h.client(room.members[0][1])
    b = await h.client(room.members[1][1])
    with pytest.raises(HubError) as e:
        await a.request("grab", group=room.group, packet=999_999)
    assert e.value.code == "packet_not_found"
    await a.request("chat", group=room.group, text="hello")
    before = []
    ev = await b.next_event()
    while ev["event"] != "chat":
        before.append(ev["event"])
        ev = await b.next_event()
    assert ev["data"]["text"] == "hello"
    assert "grabs" not in before  # the failed grab announced nothing
    await a.close()
    await b.close()


async def test_tokens_are_checked(h: HubUnderTest) -> None:
    uid, token = await h.login("li")
    secret = h.settings.secret.encode()
    head, _, sig = token.split(".")
    other = make_token(secret, uid + 1, int(time.time()), 600).split(".")[1]
    tampered = f"{head}.{other}.{sig}"  # another user's claims under this token's signature
    expired = make_token(secret, uid, 1_000, 10)
    forged = make_token(b"another-secret-of-thirty-two-characters", uid, 2_000_000_000, 10)
    for bad in ["", "garbage", tampered, expired, forged]:
        with pytest.raises(ConnectionClosed) as e:
            c = await HubClient.connect(h.ws, bad)
            await c.next_event()
        assert e.value.rcvd is not None and e.value.rcvd.code == protocol.CLOSE_UNAUTHORIZED
    assert (await h.api("GET", "/api/me", tampered))["error"]["code"] == "token_invalid"
    assert (await h.api("GET", "/api/me", expired))["error"]["code"] == "token_expired"


async def test_non_members_see_nothing_and_may_do_nothing(h: HubUnderTest) -> None:
    room = await make_room(h, 1)
    _, stranger_token = await h.login("stranger")
    await h.api("POST", "/api/topup", stranger_token, amount=10_000, request_id="s")
    stranger = await h.client(stranger_token)
    admin = await h.client(room.admin_token)
    assert stranger.groups == []
    sent = await admin.request("send", group=room.group, total=100, count=1)
    for kind, fields in [
        ("grab", {"packet": sent["packet_id"]}),
        ("send", {"total": 100, "count": 1}),
        ("chat", {"text": "hi"}),
        ("open", {"packet": sent["packet_id"]}),
    ]:
        with pytest.raises(HubError) as e:
            await stranger.request(kind, group=room.group, **fields)
        assert e.value.code == "not_member"
    # Members may not send in an admins-only group.
    member = await h.client(room.members[0][1])
    with pytest.raises(HubError) as e:
        await member.request("send", group=room.group, total=100, count=1)
    assert e.value.code == "not_admin"
    await admin.request("chat", group=room.group, text="private")
    assert (await events_of(member, 1, "chat"))[0]["data"]["text"] == "private"  # type: ignore[index]
    assert stranger.events.empty()
    # The member list (names for the page) is for members only.
    listed = await h.api("GET", f"/api/groups/{room.group}/members", room.members[0][1])
    assert [(m["user_id"], m["role"]) for m in listed["members"]] == [
        (room.admin, "admin"),
        (room.members[0][0], "member"),
    ]
    refused = await h.api("GET", f"/api/groups/{room.group}/members", stranger_token)
    assert refused["error"]["code"] == "not_member"
    for c in (stranger, admin, member):
        await c.close()


async def test_a_removed_admin_loses_the_group_on_the_live_socket(h: HubUnderTest) -> None:
    room = await make_room(h, 1)
    owner = await h.client(room.admin_token)
    second_uid, second_token = room.members[0]
    await h.api("POST", f"/api/groups/{room.group}/admins/{second_uid}", room.admin_token)
    await h.api("POST", "/api/topup", second_token, amount=1_000, request_id="t")
    second = await h.client(second_token)
    # As an admin, the second user may send...
    await second.request("send", group=room.group, total=100, count=1)
    await h.api("DELETE", f"/api/groups/{room.group}/members/{second_uid}", room.admin_token)
    notice = await second.next_notice()
    while notice["type"] != "removed":
        notice = await second.next_notice()
    assert notice["group"] == room.group
    # ...and once removed, on the same socket, may do nothing in the group.
    for kind, fields in [("chat", {"text": "still here?"}), ("send", {"total": 100, "count": 1})]:
        with pytest.raises(HubError) as e:
            await second.request(kind, group=room.group, **fields)
        assert e.value.code == "not_member"
    await owner.request("chat", group=room.group, text="after removal")
    await owner.request("chat", group=room.group, text="second")
    # The owner hears their own messages; the removed member's socket gets nothing of the group any more.
    await events_of(owner, 2, "chat")
    assert all(ev["event"] != "chat" for ev in list(second.events._queue))  # type: ignore[attr-defined]
    await owner.close()
    await second.close()


async def _presence_seen(c: HubClient, user: int, online: bool) -> None:
    while True:
        ev = await c.next_event()
        if ev["event"] == "presence" and ev["data"] == {"user": user, "online": online}:
            return


async def test_reconnect_replays_exactly_what_was_missed(h: HubUnderTest) -> None:
    room = await make_room(h, 2)
    talker = await h.client(room.members[0][1])
    listener = await h.client(room.members[1][1])
    for i in range(3):
        await talker.request("chat", group=room.group, text=f"before {i}")
    seen = await events_of(listener, 3, "chat")
    offsets = dict(listener.offsets)
    await listener.close()
    who = room.members[1][0]
    await _presence_seen(talker, who, online=False)
    for i in range(5):
        await talker.request("chat", group=room.group, text=f"missed {i}")
    back = await h.client(room.members[1][1], sync=False)
    await _presence_seen(talker, who, online=True)  # published by the hub on its own, not before the sync
    back.offsets = dict(offsets)
    reply = await back.sync()
    # The listener's leaving, the five chats, and its coming back.
    assert reply["groups"][str(room.group)]["replayed"] == 7
    replayed = await events_of(back, 5, "chat")
    assert [e["data"]["text"] for e in replayed] == [f"missed {i}" for i in range(5)]  # type: ignore[index]
    assert all(offset_key(str(e["offset"])) > offset_key(str(seen[-1]["offset"])) for e in replayed)
    # Live events continue after the replay, in order.
    await talker.request("chat", group=room.group, text="live")
    assert (await events_of(back, 1, "chat"))[0]["data"]["text"] == "live"  # type: ignore[index]

    # An offset older than what the stream keeps: "too old", with the open packets to reload from.
    admin = await h.client(room.admin_token)
    sent = await admin.request("send", group=room.group, total=300, count=3)
    await h.core.redis.xtrim(keys.group_events(room.group), maxlen=0, approximate=False)
    late = await h.client(room.members[1][1], sync=False)
    late.offsets = dict(offsets)
    state = (await late.sync())["groups"][str(room.group)]
    assert state["too_old"] is True
    assert [p["packet_id"] for p in state["packets"]] == [sent["packet_id"]]
    for c in (talker, back, admin, late):
        await c.close()


async def test_bad_frames_get_errors_and_the_hub_keeps_serving(h: HubUnderTest) -> None:
    room = await make_room(h, 1)
    bad = await h.client(room.members[0][1])
    good = await h.client(room.admin_token)

    async def raw_reply(frame: bytes | str) -> dict[str, object]:
        await bad.send_raw(frame)
        while True:
            notice = await bad.next_notice()
            if notice.get("type") == "reply":
                return notice

    # Replies to frames without a readable id arrive as notices (the client cannot route them).
    bad._waiting.clear()
    for frame, code in [
        (b"\xc1\xff\x00garbage", "bad_frame"),
        ("{not json", "bad_frame"),
        (b"\x93\x01\x02\x03", "bad_request"),  # a msgpack array, not a map
    ]:
        reply = await raw_reply(frame)
        assert reply["ok"] is False and reply["error"]["code"] == code  # type: ignore[index]
    for kind, fields, code in [
        ("dance", {}, "unknown_type"),
        ("grab", {"group": room.group, "packet": "seven"}, "bad_request"),
        ("grab", {"group": "one", "packet": 1}, "bad_request"),
        ("chat", {"group": room.group, "text": ""}, "text_invalid"),
        ("send", {"group": room.group, "total": 100, "count": 1}, "not_admin"),
    ]:
        with pytest.raises(HubError) as e:
            await bad.request(kind, **fields)
        assert e.value.code == code, (kind, fields)
    with pytest.raises(HubError) as e:
        await good.request("send", group=room.group, total=-1, count=1)
    assert e.value.code == "amount_invalid"
    # A frame over the size limit closes that socket with 1009; everyone else is still served.
    await bad.send_raw(b"\x00" * (h.settings.ws_max_frame_bytes + 1))
    await eventually(lambda: bad.ws.close_code is not None)
    assert bad.ws.close_code == protocol.CLOSE_TOO_BIG
    assert "ts" in await good.request("ping")
    await good.close()
    await bad.close()


async def test_a_client_that_never_reads_is_dropped_and_the_room_gets_everything(
    hub_settings: Settings,
) -> None:
    s = hub_settings.replace(
        msgs_per_second=1e6,
        msgs_burst=10**6,
        user_msgs_per_second=1e6,
        user_msgs_burst=10**6,
        ws_bytes_per_second=10**9,  # (its talker sends 7.6 MB as fast as the hub answers)
        send_queue_frames=64,
    )
    async with hub_in_process(s) as h:
        await _never_reads(h)


async def _never_reads(h: HubUnderTest) -> None:
    room = await make_room(h, 2)
    reader = await h.client(room.members[0][1])
    slow = await h.client(room.members[1][1], max_queue=1, max_size=None)
    slow_conn = next(c for c in h.hub.by_user[room.members[1][0]])
    slow._reader.cancel()  # type: ignore[union-attr]  # stop reading: the TCP window fills
    talker = await h.client(room.admin_token)
    text = "x" * 1900
    n = 4000
    for i in range(n):
        await talker.request("chat", group=room.group, text=f"{i}:{text}")
    got = await events_of(reader, n, "chat")
    assert [int(str(e["data"]["text"]).split(":")[0]) for e in got] == list(range(n))  # type: ignore[index]
    assert slow_conn.close_code == protocol.CLOSE_SLOW_CONSUMER
    assert room.members[1][0] not in h.hub.by_user
    assert h.hub.metrics.send_queue_drops._value.get() == 1
    # The hub dropped the socket: the slow client, reading again, finds it closed.
    with pytest.raises(ConnectionClosed):
        while True:
            await asyncio.wait_for(slow.ws.recv(), 10)
    await slow.close()
    await reader.close()
    await talker.close()


async def test_rate_limits_and_blocks(hub_settings: Settings) -> None:
    s = hub_settings.replace(grabs_per_second=0.001, grabs_burst=2, msgs_per_second=0.001, msgs_burst=5)
    async with hub_in_process(s) as h:
        room = await make_room(h, 1)
        admin = await h.client(room.admin_token)
        member = await h.client(room.members[0][1])
        # Two shares: the second is still there when the blocked admin tries (a grab of a packet the hub
        # knows is empty is answered packet_empty before any block: server.hub.packetcache).
        sent = await admin.request("send", group=room.group, total=300, count=2)
        codes = []
        for _ in range(3):
            try:
                codes.append(
                    (await member.request("grab", group=room.group, packet=sent["packet_id"]))["outcome"]
                )
            except HubError as e:
                codes.append(e.code)
        assert codes == ["won", "already", "rate_limited"]
        await block(h.core, room.admin)
        with pytest.raises(HubError) as e:
            await admin.request("grab", group=room.group, packet=sent["packet_id"])
        assert e.value.code == "blocked"
        # Flooding one socket: errors first, then the hub closes it; the others are untouched.
        flooder = await h.client(room.members[0][1], sync=False)
        for i in range(20):
            await flooder.send_raw(flooder.encode({"id": i, "type": "ping"}))
        await eventually(lambda: flooder.ws.close_code is not None)
        answers = []
        while not flooder.notices.empty():
            answers.append(flooder.notices.get_nowait())
        assert [a["error"]["code"] for a in answers if a["type"] == "reply" and not a["ok"]][:1] == [
            "rate_limited"
        ]
        assert flooder.ws.close_code == protocol.CLOSE_RATE_LIMITED
        await admin.close()
        await member.close()


async def test_presence_across_connections(h: HubUnderTest) -> None:
    room = await make_room(h, 2)
    a = await h.client(room.members[0][1])
    b = await h.client(room.members[1][1])
    await eventually(lambda: a.request("presence", group=room.group))
    online = (await a.request("presence", group=room.group))["online"]
    assert sorted(online) == sorted([room.members[0][0], room.members[1][0]])
    await b.close()
    left = await events_of(a, 1, "presence")
    while left[0]["data"] != {"user": room.members[1][0], "online": False}:
        left = await events_of(a, 1, "presence")
    assert (await a.request("presence", group=room.group))["online"] == [room.members[0][0]]
    await a.close()


async def test_dead_connections_are_found_by_heartbeat(hub_settings: Settings) -> None:
    s = hub_settings.replace(ws_ping_interval=0.2, ws_ping_timeout=0.2)
    async with hub_in_process(s) as h:
        uid, token = await h.login("ghost")
        # A client that completes the handshake and then never answers a ping.
        ws = await websockets.connect(f"{h.ws}?token={token}", ping_interval=None, max_queue=1)
        ws.transport.pause_reading()  # type: ignore[attr-defined]
        await eventually(lambda: uid in h.hub.by_user)
        await eventually(lambda: uid not in h.hub.by_user, timeout=30)
        ws.transport.abort()  # type: ignore[attr-defined]


async def test_pubsub_blip_loses_nothing(h: HubUnderTest) -> None:
    room = await make_room(h, 1)
    listener = await h.client(room.members[0][1])
    talker = await h.client(room.admin_token)
    before = h.hub.metrics.pubsub_reconnects._value.get()
    await h.core.redis.client_kill_filter(_type="pubsub")
    for i in range(20):
        await talker.request("chat", group=room.group, text=str(i))
    got = await events_of(listener, 20, "chat")
    assert [e["data"]["text"] for e in got] == [str(i) for i in range(20)]  # type: ignore[index]
    await eventually(lambda: h.hub.metrics.pubsub_reconnects._value.get() > before)
    await listener.close()
    await talker.close()


async def test_grab_storm_is_announced_in_coalesced_events(h: HubUnderTest) -> None:
    room = await make_room(h, 30)
    admin = await h.client(room.admin_token)
    clients = [await h.client(t, sync=True) for _, t in room.members]
    sent = await admin.request("send", group=room.group, total=3_000, count=30)
    await asyncio.gather(*(c.request("grab", group=room.group, packet=sent["packet_id"]) for c in clients))
    seen: list[dict[str, object]] = []
    announcements = 0
    while len(seen) < 30:
        ev = await admin.next_event()
        if ev["event"] == "grabs":
            announcements += 1
            seen += ev["data"]["grabs"]  # type: ignore[index]
    assert sorted(g["user"] for g in seen) == sorted(u for u, _ in room.members)  # type: ignore[index]
    assert sum(g["amount"] for g in seen) == 3_000  # type: ignore[index]
    assert announcements < 30
    fin = (await events_of(admin, 1, "finished"))[0]
    assert fin["data"]["packet_id"] == sent["packet_id"]  # type: ignore[index]
    for c in [admin, *clients]:
        await c.close()


async def test_a_bot_that_grabs_faster_than_a_human_is_blocked_and_can_be_lifted(
    hub_settings: Settings,
) -> None:
    s = hub_settings.replace(grabs_per_second=1000, grabs_burst=1000)
    async with hub_in_process(s) as h:
        room = await make_room(h, 2)
        admin = await h.client(room.admin_token)
        bot_uid, bot_token = room.members[0]
        bot = await h.client(bot_token, device="farm-1")
        for _ in range(3):
            sent = await admin.request("send", group=room.group, total=200, count=2)
            ev = (await events_of(bot, 1, "packet"))[0]
            assert ev["data"]["packet_id"] == sent["packet_id"]  # type: ignore[index]
            await bot.request("grab", group=room.group, packet=sent["packet_id"])  # at once: a bot
        await h.hub.attempts.flush()
        seen = await bots.recent_attempts(h.core, now_ms())
        assert len(seen) == 3 and {a.user for a in seen} == {bot_uid}
        assert all(a.reaction_ms is not None and a.reaction_ms < 100 and a.device == "farm-1" for a in seen)
        decisions = await bots.run_detector(h.core)
        assert set(decisions) == {bot_uid} and decisions[bot_uid].action == "block"
        sent = await admin.request("send", group=room.group, total=200, count=2)
        with pytest.raises(HubError) as e:
            await bot.request("grab", group=room.group, packet=sent["packet_id"])
        assert e.value.code == "blocked"
        assert [b.user for b in await bots.list_blocks(h.core)] == [bot_uid]
        assert await bots.lift(h.core, bot_uid)
        assert (await bot.request("grab", group=room.group, packet=sent["packet_id"]))["outcome"] == "won"
        await admin.close()
        await bot.close()


async def test_a_second_sync_never_resends_what_the_socket_already_has(h: HubUnderTest) -> None:
    import msgpack

    room = await make_room(h, 1)
    talker = await h.client(room.admin_token)
    raw = await websockets.connect(
        f"{h.ws}?token={room.members[0][1]}", subprotocols=["redpacket.v1.msgpack"]
    )  # type: ignore[list-item]
    welcome = msgpack.unpackb(await raw.recv())
    assert welcome["type"] == "welcome"
    await raw.send(msgpack.packb({"id": 1, "type": "sync", "groups": {str(room.group): None}}))
    frames: list[dict[str, object]] = []
    while True:
        f = msgpack.unpackb(await asyncio.wait_for(raw.recv(), 10))
        if f.get("type") == "reply" and f.get("id") == 1:
            start = f["data"]["groups"][str(room.group)]["offset"]
            break
        frames.append(f)
    for i in range(3):
        await talker.request("chat", group=room.group, text=str(i))
    while len([f for f in frames if f.get("event") == "chat"]) < 3:
        frames.append(msgpack.unpackb(await asyncio.wait_for(raw.recv(), 10)))
    # Sync again from before those chats: nothing this socket already received comes twice.
    await raw.send(msgpack.packb({"id": 2, "type": "sync", "groups": {str(room.group): start}}))
    while True:
        f = msgpack.unpackb(await asyncio.wait_for(raw.recv(), 10))
        frames.append(f)
        if f.get("type") == "reply" and f.get("id") == 2:
            break
    seen = [str(f["offset"]) for f in frames if f.get("type") == "event"]
    assert len(seen) == len(set(seen)), seen
    await raw.close()
    await talker.close()


async def test_the_demo_page_is_served_at_the_root(h: HubUnderTest) -> None:
    async with httpx.AsyncClient(base_url=h.http) as http:
        page = await http.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert '<script type="module" src="app.js">' in page.text
        for asset in ("style.css", "packet.svg", "client/redpacket.d.ts"):
            assert (await http.get(f"/{asset}")).status_code == 200, asset
        # Every module the page imports, and every module those import (the page's and the client's), as
        # the browser follows them: no build step bundles them.
        seen: set[str] = set()
        todo = ["/app.js"]
        while todo:
            path = todo.pop()
            seen.add(path)
            module = await http.get(path)
            assert module.status_code == 200, path
            assert module.headers["content-type"].startswith("text/javascript"), path
            # (A statement may span lines: `[^;]` takes newlines too.)
            for target in re.findall(r'^(?:import|export)\b[^;]*?\bfrom\s*"([^"]+)";', module.text, re.M):
                found = urllib.parse.urljoin(path, target)
                if found not in seen:
                    todo.append(found)
        # ... which are every module of the page and of the client: none is left out, none is orphaned.
        on_disk = {f"/{m.name}" for m in (ROOT / "web").glob("*.js")}
        on_disk |= {f"/client/{m.name}" for m in (ROOT / "clients" / "js").glob("*.js")}
        assert seen == on_disk, seen ^ on_disk
        assert (await http.get("/nope.js")).status_code == 404


async def test_what_a_client_words_its_messages_with(hub_settings: Settings) -> None:
    """The limits in the welcome, the limit a refused send broke, every unknown name of an add, and the
    sender and greeting of what one received: what the demo page says to people instead of codes."""
    async with hub_in_process(hub_settings, run_worker=True) as h:
        room = await make_room(h, 2, prefix="w")
        admin = await h.client(room.admin_token, "json")
        s = h.settings
        assert admin.welcome["limits"] == {
            "max_total_cents": s.max_total_cents,
            "max_count": s.max_count,
            "max_greeting_chars": s.max_greeting_chars,
            "packet_ttl_seconds": s.packet_ttl_seconds,
        }
        refusals = [
            ({"total": s.max_total_cents + 1, "count": 1}, "amount_too_large", s.max_total_cents),
            ({"total": 500, "count": s.max_count + 1}, "count_too_large", s.max_count),
            ({"total": 500, "count": 4}, "count_too_large", 3),  # the group's members: admin and two
            (
                {"total": 500, "count": 1, "greeting": "x" * (s.max_greeting_chars + 1)},
                "greeting_too_long",
                s.max_greeting_chars,
            ),
        ]
        for fields, code, limit in refusals:
            with pytest.raises(HubError) as refused:
                await admin.request("send", group=room.group, **fields)
            assert (refused.value.code, refused.value.details) == (code, {"limit": limit}), fields

        await h.login("wknown")
        members = await h.api("GET", f"/api/groups/{room.group}/members", room.admin_token)
        answer = await h.api(
            "POST",
            f"/api/groups/{room.group}/members",
            room.admin_token,
            names=["nobody1", "wknown", "nobody2"],
        )
        assert answer["error"]["code"] == "user_not_found"
        assert answer["error"]["names"] == ["nobody1", "nobody2"]
        # Nobody was added, not even the name that exists: the admin sends the list again, fixed.
        assert await h.api("GET", f"/api/groups/{room.group}/members", room.admin_token) == members

        sent = await admin.request("send", group=room.group, total=300, count=2, greeting="恭喜发财")
        _, member_token = room.members[0]
        member = await h.client(member_token)
        won = await member.request("grab", group=room.group, packet=sent["packet_id"])
        mine: dict[str, Any] = {}

        async def credited() -> bool:  # a grab is listed once the worker has credited it
            mine.update(await h.api("GET", "/api/me/packets/received", member_token))
            return bool(mine["packets"])

        await eventually(credited)
        assert mine["packets"][0] == {
            "status": "credited",
            "packet_id": sent["packet_id"],
            "group_id": room.group,
            "amount": won["amount"],
            "grabbed_ms": won["grabbed_ms"],
            "sender_id": room.admin,
            "sender_name": "wadmin",
            "kind": "lucky",
            "greeting": "恭喜发财",
        }
        for c in (admin, member):
            await c.close()


async def test_grab_attempts_are_written_one_stream_entry_per_interval(h: HubUnderTest) -> None:
    log = bots.AttemptLog(h.core, interval=3600)  # only an explicit flush writes
    now = now_ms()
    log.record(
        Attempt(user=1, group=2, packet=3, reaction_ms=None, device="d", ms=now - 120_000)
    )  # outside the detector's minute
    for i in range(500):
        log.record(Attempt(user=10 + i, group=2, packet=3, reaction_ms=50, device="phone", ms=now - i))
    before = int(await h.core.redis.xlen(keys.grab_attempts()))
    await log.close()
    assert int(await h.core.redis.xlen(keys.grab_attempts())) == before + 1
    seen = [a for a in await bots.recent_attempts(h.core, now) if a.device == "phone"]
    assert sorted(a.user for a in seen) == list(range(10, 510))
    assert all(a.ms >= now - 60_000 for a in await bots.recent_attempts(h.core, now))


@needs_redis_server
async def test_grab_attempts_a_redis_away_could_not_take_are_written_once_it_is_back(
    h: HubUnderTest, tmp_path: Path
) -> None:
    """Redis dies under a hub: the attempts are kept (those the detector still reads), the write is
    tried again after a growing pause, not every interval, and once Redis is back they go out by
    themselves, none dropped, no task dead."""
    async with redis_process(tmp_path) as r, open_core(h.core.settings.replace(redis_url=r.url)) as c:
        log = bots.AttemptLog(c, interval=0.05)
        now = now_ms()
        await r.kill()
        log.record(
            Attempt(user=99, group=2, packet=3, reaction_ms=40, device="tablet", ms=now - 120_000)
        )  # past the detector's minute
        for i in range(3):
            log.record(Attempt(user=100 + i, group=2, packet=3, reaction_ms=40, device="tablet", ms=now - i))
        await eventually(lambda: log.failures >= 3, timeout=30)
        assert sorted(cast(int, a[0]) for a in log.pending) == [100, 101, 102]
        assert log.pause >= bots.RETRY_AFTER[2] > log.interval  # not tried again every interval
        log.record(Attempt(user=103, group=2, packet=3, reaction_ms=40, device="tablet", ms=now))
        await r.start()
        await eventually(lambda: log.failures == 0 and not log.pending, timeout=30)  # a write went out
        seen = [a for a in await bots.recent_attempts(c, now) if a.device == "tablet"]
        assert sorted(a.user for a in seen) == [100, 101, 102, 103]
        await log.close()
        log.record(Attempt(user=104, group=2, packet=3, reaction_ms=40, device="tablet", ms=now))
        assert log.timer is None  # closed: nothing is written any more


async def test_a_big_room_storm_sends_each_member_a_bounded_list(hub_settings: Settings) -> None:
    s = hub_settings.replace(big_room_online=3, big_room_grabs_listed=2, grab_coalesce_ms=200)
    async with hub_in_process(s) as h:
        room = await make_room(h, 12)
        admin = await h.client(room.admin_token)
        clients = [await h.client(t) for _, t in room.members]
        sent = await admin.request("send", group=room.group, total=1_200, count=12)
        await asyncio.gather(
            *(c.request("grab", group=room.group, packet=sent["packet_id"]) for c in clients)
        )
        listed = more = 0
        while True:
            ev = await admin.next_event()
            data: Any = ev["data"]
            if ev["event"] in ("grabs", "finished"):  # (the last grabs ride on finished in a big room)
                assert len(data.get("grabs", [])) <= 2
                listed += len(data.get("grabs", []))
                more += data.get("more", 0)
                if "more" in data and ev["event"] == "grabs":
                    assert data["remaining"][str(sent["packet_id"])] == data["grabs"][-1]["remaining"]
            if ev["event"] == "finished":
                break
        assert listed + more == 12 and more > 0  # every grab counted, not every grab listed
        assert len((await admin.request("open", group=room.group, packet=sent["packet_id"]))["grabs"]) == 12
        for c in [admin, *clients]:
            await c.close()


async def test_a_hot_packet_in_a_big_room_is_shown_by_its_finished_event_alone(
    hub_settings: Settings,
) -> None:
    # An interval far longer than the storm: the packet empties before any grabs event is due.
    s = hub_settings.replace(big_room_online=3, big_room_grabs_listed=2, big_room_frames_per_second=1)
    async with hub_in_process(s) as h:
        room = await make_room(h, 6)
        admin = await h.client(room.admin_token)
        clients = [await h.client(t) for _, t in room.members]
        sent = await admin.request("send", group=room.group, total=600, count=6)
        won = await asyncio.gather(
            *(c.request("grab", group=room.group, packet=sent["packet_id"]) for c in clients)
        )
        assert sorted(w["seq"] for w in won) == list(range(1, 7))
        for c in [admin, *clients]:
            kinds = []
            while not kinds or kinds[-1] != "finished":
                ev = await c.next_event()
                kinds.append(ev["event"])
            # One frame for the storm: the packet's grabs (the latest two listed, four more) ride on it.
            assert "grabs" not in kinds
            assert len(ev["data"]["grabs"]) == 2 and ev["data"]["more"] == 4
            assert ev["data"]["grabs"][-1]["remaining"] == 0
        for c in [admin, *clients]:
            await c.close()


async def test_a_fresh_sync_lists_only_packets_that_can_still_be_grabbed(h: HubUnderTest) -> None:
    room = await make_room(h, 1)
    admin = await h.client(room.admin_token)
    member = await h.client(room.members[0][1])
    emptied = await admin.request("send", group=room.group, total=100, count=1)
    await member.request("grab", group=room.group, packet=emptied["packet_id"])
    open_one = await admin.request("send", group=room.group, total=200, count=1)
    fresh = await h.client(room.members[0][1], sync=False)
    state = (await fresh.sync())["groups"][str(room.group)]
    assert [p["packet_id"] for p in state["packets"]] == [open_one["packet_id"]]
    for c in (admin, member, fresh):
        await c.close()


def _answered_locally(h: HubUnderTest) -> float:
    return float(h.hub.metrics.grabs_answered_locally._value.get())


async def test_grabs_of_a_closed_or_unknown_packet_are_answered_by_the_hub(h: HubUnderTest) -> None:
    room = await make_room(h, 3, "closed")
    admin = await h.client(room.admin_token)
    winner = await h.client(room.members[0][1])
    late = await h.client(room.members[1][1])
    sent = await admin.request("send", group=room.group, total=100, count=1)
    won = await winner.request("grab", group=room.group, packet=sent["packet_id"])
    assert (won["outcome"], won["remaining"]) == ("won", 0)
    # The last share went: the hub reads the packet's final state once, then answers from memory.
    await eventually(lambda: sent["packet_id"] in h.hub.packet_cache.closed)
    before = _answered_locally(h)
    with pytest.raises(HubError) as e:
        await late.request("grab", group=room.group, packet=sent["packet_id"])
    assert e.value.code == "packet_empty"
    assert _answered_locally(h) == before + 1
    # The winner's repeat still goes to Redis, and answers the same share.
    again = await winner.request("grab", group=room.group, packet=sent["packet_id"])
    assert (again["outcome"], again["amount"], again["seq"]) == ("already", won["amount"], won["seq"])
    assert _answered_locally(h) == before + 1
    # After Redis may have lost writes (a new generation), nothing known before is used.
    h.core.nodes.identities.generation += 1
    with pytest.raises(HubError) as e:
        await late.request("grab", group=room.group, packet=sent["packet_id"])
    assert e.value.code == "packet_empty"
    assert _answered_locally(h) == before + 1
    # An id that is no packet: the first grab asks the database, the next is answered from memory.
    bogus = sent["packet_id"] + 1_000_000
    for answered in (before + 1, before + 2):
        with pytest.raises(HubError) as e:
            await late.request("grab", group=room.group, packet=bogus)
        assert e.value.code == "packet_not_found"
        assert _answered_locally(h) == answered
    for c in (admin, winner, late):
        await c.close()


async def test_a_storm_sends_redis_about_as_many_grabs_as_shares(
    h: HubUnderTest, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(packetcache, "FIRST_FLIGHT", 2)
    monkeypatch.setattr(packetcache, "MIN_FLIGHT", 1)
    room = await make_room(h, 30, "storm")
    admin = await h.client(room.admin_token)
    members = [await h.client(t) for _, t in room.members]
    sent = await admin.request("send", group=room.group, total=300, count=3)
    before = _answered_locally(h)

    async def grab(c: HubClient) -> tuple[str, int]:
        try:
            r = await c.request("grab", group=room.group, packet=sent["packet_id"])
            return str(r["outcome"]), int(r["amount"])
        except HubError as e:
            return e.code, 0

    got = await asyncio.gather(*(grab(c) for c in members))
    assert sorted(o for o, _ in got).count("won") == 3
    assert [o for o, _ in got].count("packet_empty") == 27
    assert sum(a for _, a in got) == 300
    # Most of the 27 waited for a slot and were answered from the packet's final state.
    assert _answered_locally(h) - before >= 20
    assert h.hub.packet_cache.flights == {}
    for c in [admin, *members]:
        await c.close()


async def test_a_channel_left_and_wanted_again_at_once_is_not_a_moved_slot(
    h: HubUnderTest, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: `channel … left 127.0.0.1:… (its slot moved); re-routing` on one server whenever a group's
    last local member left and one came back before Redis confirmed the unsubscribe (a quick reconnect),
    and every channel was subscribed again."""
    import logging

    caplog.set_level(logging.WARNING, logger="server.hub.subscriber")
    room = await make_room(h, 1)
    listener = await h.client(room.members[0][1])
    channel = keys.group_channel(room.group)
    reconnects = h.hub.metrics.pubsub_reconnects._value.get()
    for _ in range(5):  # left, and wanted again before the reply to the unsubscribe is read
        await h.hub.subscriber.remove(channel)
        await h.hub.subscriber.add(channel)
    admin = await h.client(room.admin_token)
    await admin.request("chat", group=room.group, text="still here")
    while (ev := await listener.next_event())[
        "event"
    ] != "chat":  # replies in order: the unsubscribes' came first
        pass
    assert ev["data"]["text"] == "still here"
    assert not [r for r in caplog.records if "slot moved" in r.getMessage()]
    assert h.hub.metrics.pubsub_reconnects._value.get() == reconnects
    await listener.close()
    await admin.close()
