"""Redis going away under a running hub: every request that needs it answers ``redis_unavailable`` and
moves no money; a packet whose announcement failed after it was paid for is announced exactly once."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import httpx
import pytest
import redis

from redpacket_client.connection import HubClient, HubError
from server.live import announce
from server.money import ledger
from server.money.ledger import now_ms
from server.settings import Settings
from server.store import keys
from tests.clitools import assert_one_line_error, redpacket
from tests.hubtools import HubUnderTest, hub_in_process, make_room
from tests.redisproc import needs_redis_server, redis_process
from worker.drain import CreditDrain


async def _code(c: HubClient, kind: str, **fields: object) -> str:
    with pytest.raises(HubError) as e:
        await c.request(kind, **fields)
    return e.value.code


@needs_redis_server
async def test_while_redis_is_down_requests_answer_redis_unavailable_and_move_nothing(
    hub_settings: Settings, tmp_path: Path
) -> None:
    async with redis_process(tmp_path) as r, hub_in_process(hub_settings.replace(redis_url=r.url)) as h:
        room = await make_room(h, 1)
        admin = await h.client(room.admin_token)
        member = await h.client(room.members[0][1])
        before = await admin.request("send", group=room.group, total=500, count=1)
        assert (await _event(member, "packet"))["data"]["packet_id"] == before["packet_id"]  # type: ignore[index]
        await r.kill()
        g = room.group
        assert await _code(admin, "chat", group=g, text="hello") == "redis_unavailable"
        send = {"group": g, "total": 300, "count": 1, "request_id": "during"}
        assert await _code(admin, "send", **send) == "redis_unavailable"
        assert await _code(member, "grab", group=g, packet=before["packet_id"]) == "redis_unavailable"
        assert await _code(member, "open", group=g, packet=before["packet_id"]) == "redis_unavailable"
        assert await _code(member, "presence", group=g) == "redis_unavailable"
        assert await _code(member, "sync", groups={str(g): None}) == "redis_unavailable"
        assert (await member.request("ping"))["ts"] > 0  # needs no Redis
        async with httpx.AsyncClient(base_url=h.http, timeout=10) as http:
            health = await http.get("/healthz")
        assert health.status_code == 503 and health.json()["error"]["code"] == "redis_unavailable"
        me = await h.api("GET", "/api/me", room.admin_token)
        assert me["balance"] == 1_000_000 - 500  # the refused send debited nothing
        rows = await h.core.db.fetchone("SELECT COUNT(*) FROM red_packets")
        assert rows is not None and int(rows[0]) == 1

        await r.start()  # back, with its AOF: the same sockets work again, no process restarted
        sent = await _retry(lambda: admin.request("send", **send))
        assert sent["replay"] is False and sent["offset"] is not None
        seen = await _event(member, "packet")
        assert seen["data"]["packet_id"] == sent["packet_id"]  # type: ignore[index]
        got = await member.request("grab", group=g, packet=before["packet_id"])
        assert got["amount"] == 500
        for c in (admin, member):
            await c.close()


@needs_redis_server
async def test_while_redis_hangs_requests_and_healthz_answer_within_the_bound(
    hub_settings: Settings, tmp_path: Path
) -> None:
    """A Redis that stops answering without closing (SIGSTOP: a stall, a network that drops packets) is an
    error within ``REDPACKET_REDIS_TIMEOUT_MS``, not a wait: every answer below comes while it is still
    stopped (without the bound, the grab waited for as long as Redis did)."""
    settings = hub_settings.replace(redis_timeout_ms=500)
    async with redis_process(tmp_path) as r, hub_in_process(settings.replace(redis_url=r.url)) as h:
        room = await make_room(h, 1)
        admin = await h.client(room.admin_token)
        member = await h.client(room.members[0][1])
        g = room.group
        before = await admin.request("send", group=g, total=500, count=1)
        assert r.proc is not None
        r.proc.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(redis.TimeoutError):  # the state: connected, and nothing answers
                redis.Redis.from_url(r.url, socket_timeout=0.5).ping()
            grab = {"group": g, "packet": before["packet_id"]}
            assert await _code(member, "grab", **grab) == "redis_unavailable"
            assert await _code(admin, "send", group=g, total=300, count=1) == "redis_unavailable"
            assert (await member.request("ping"))["ts"] > 0
            async with httpx.AsyncClient(base_url=h.http, timeout=10) as http:
                health = await http.get("/healthz")
            assert health.status_code == 503 and health.json()["error"]["code"] == "redis_unavailable"
            with pytest.raises(redis.TimeoutError):  # all of it answered while Redis was still stopped
                redis.Redis.from_url(r.url, socket_timeout=0.5).ping()
        finally:
            r.proc.send_signal(signal.SIGCONT)
        got = await _retry(lambda: member.request("grab", group=g, packet=before["packet_id"]))
        assert got["amount"] == 500 and got["outcome"] == "won"
        for c in (admin, member):
            await c.close()


@needs_redis_server
async def test_an_evicting_redis_is_refused_at_start_and_its_grabs_once_it_turns_so(
    hub_settings: Settings, tmp_path: Path, mysql_url: str
) -> None:
    """Under any policy but noeviction, memory pressure drops keys: a packet's shares and grabs (they
    expire, so volatile-* too) and credits not yet paid. A hub and a worker refuse to start on such a
    master; one changed while they run gets no grab (answered ``redis_unavailable``), ``/healthz`` says
    so and the gauge counts it, until it is noeviction again."""
    async with redis_process(tmp_path, "--maxmemory-policy", "allkeys-lru") as r:
        for command in (("serve", "--port", "0"), ("worker",)):
            done = await asyncio.to_thread(
                redpacket, *command, REDPACKET_REDIS_URL=r.url, REDPACKET_DATABASE_URL=mysql_url,
                REDPACKET_SECRET="s" * 32, REDPACKET_DATA_DIR=str(tmp_path / "data"),
            )  # fmt: skip
            assert_one_line_error(done, 1, "maxmemory-policy is allkeys-lru", "noeviction")
        raw = redis.Redis.from_url(r.url)
        raw.config_set("maxmemory-policy", "noeviction")
        async with hub_in_process(hub_settings.replace(redis_url=r.url)) as h:
            room = await make_room(h, 2)
            admin = await h.client(room.admin_token)
            first, second = [await h.client(t) for _, t in room.members]
            g = room.group
            sent = await admin.request("send", group=g, total=500, count=2)
            won = await first.request("grab", group=g, packet=sent["packet_id"])
            assert won["outcome"] == "won"
            raw.config_set("maxmemory-policy", "volatile-lru")
            assert raw.config_get("maxmemory-policy") == {"maxmemory-policy": "volatile-lru"}  # the state
            h.core.nodes.look_again(h.core.nodes.client)  # (as 10 ms after its last look: it reads first)
            assert await _code(second, "grab", group=g, packet=sent["packet_id"]) == "redis_unavailable"
            async with httpx.AsyncClient(base_url=h.http, timeout=10) as http:
                health = await http.get("/healthz")
            assert health.status_code == 503 and "maxmemory-policy volatile-lru" in health.text
            # What pays out goes on: the first winner's credit is paid from the evicting master.
            assert await CreditDrain(h.core).until_empty() == 1
            assert await ledger.balance(h.core.db, room.members[0][0]) == won["amount"]
            assert h.hub.metrics.redis_evicting.collect()[0].samples[0].value == 1
            raw.config_set("maxmemory-policy", "noeviction")
            got = await _retry(lambda: second.request("grab", group=g, packet=sent["packet_id"]))
            assert got["outcome"] == "won"
            for c in (admin, first, second):
                await c.close()
        raw.close()


async def _retry(call: object, timeout: float = 30) -> dict[str, object]:
    """Retry a request that answers redis_unavailable until Redis is back (bounded)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            return await call()  # type: ignore[operator, no-any-return]
        except HubError as e:
            if e.code != "redis_unavailable" or loop.time() > deadline:
                raise
        await asyncio.sleep(0.05)


async def _event(c: HubClient, kind: str) -> dict[str, object]:
    while True:
        ev = await c.next_event()
        if ev["event"] == kind:
            return ev


async def _packet_events(h: HubUnderTest, group: int, packet_id: int) -> list[str]:
    """The offsets of the group stream's ``packet`` events for this packet."""
    from server.live import events

    missed = await events.since(h.core, group, "0-0", 10_000)
    return [o for o, kind, data in missed.events if kind == "packet" and data["packet_id"] == packet_id]


async def test_a_paid_packet_whose_publish_failed_is_announced_once_by_a_retry_or_the_worker(
    hub_settings: Settings,
) -> None:
    async with hub_in_process(hub_settings) as h:
        room = await make_room(h, 1)
        admin = await h.client(room.admin_token)
        member = await h.client(room.members[0][1])
        g = room.group
        stream = keys.group_events(g)
        bad_stream = lambda: h.core.redis.set(stream, "not a stream")  # noqa: E731 - makes XADD fail

        # The publish fails after the packet was paid for and saved: the send still succeeds, unannounced.
        await bad_stream()
        first = await admin.request("send", group=g, total=400, count=1, request_id="r1")
        assert first["offset"] is None and first["replay"] is False
        assert (await h.api("GET", "/api/me", room.admin_token))["balance"] == 1_000_000 - 400
        await h.core.redis.delete(stream)
        # The sender's retry announces it, once.
        again = await admin.request("send", group=g, total=400, count=1, request_id="r1")
        assert again["replay"] is True and again["offset"] is not None
        assert (await _event(member, "packet"))["data"]["packet_id"] == first["packet_id"]  # type: ignore[index]
        third = await admin.request("send", group=g, total=400, count=1, request_id="r1")
        assert third["offset"] == again["offset"]
        assert await _packet_events(h, g, int(first["packet_id"])) == [again["offset"]]

        # Nobody retries this one: the worker finds it and announces it, once.
        await bad_stream()
        second = await admin.request("send", group=g, total=300, count=1, request_id="r2")
        assert second["offset"] is None
        await h.core.redis.delete(stream)
        later = now_ms() + announce.WORKER_AFTER_MS
        assert await announce.announce_pending(h.core, now=later) == 1
        assert await announce.announce_pending(h.core, now=later) == 0
        assert (await _event(member, "packet"))["data"]["packet_id"] == second["packet_id"]  # type: ignore[index]
        offsets = await _packet_events(h, g, int(second["packet_id"]))
        assert len(offsets) == 1
        retried = await admin.request("send", group=g, total=300, count=1, request_id="r2")
        assert retried["offset"] == offsets[0] and retried["replay"] is True
        assert await _packet_events(h, g, int(second["packet_id"])) == offsets
        got = await member.request("grab", group=g, packet=second["packet_id"])
        assert got["amount"] == 300
        # And the database says both were announced.
        rows = await h.core.db.fetchall("SELECT announced_ms FROM red_packets ORDER BY id")
        assert all(r[0] is not None for r in rows)
        for c in (admin, member):
            await c.close()


async def test_grab_announcements_survive_failed_publishes_and_come_once_in_order(
    hub_settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    async with hub_in_process(hub_settings) as h:
        room = await make_room(h, 2)
        admin = await h.client(room.admin_token)
        grabbers = [await h.client(t) for _, t in room.members]
        g = room.group
        sent = await admin.request("send", group=g, total=900, count=2)
        assert (await _event(admin, "packet"))["data"]["packet_id"] == sent["packet_id"]  # type: ignore[index]
        stream = keys.group_events(g)
        await h.core.redis.set(stream, "not a stream")  # every publish to the group fails from here
        got = [await c.request("grab", group=g, packet=sent["packet_id"]) for c in grabbers]
        assert sum(int(r["amount"]) for r in got) == 900  # the grabs themselves need no announcement
        await h.core.redis.delete(stream)  # Redis takes publishes again: the retries go through
        grabs: list[dict[str, object]] = []
        while True:
            ev = await admin.next_event(timeout=30)
            if ev["event"] == "finished":
                break
            assert ev["event"] == "grabs"
            grabs += ev["data"]["grabs"]  # type: ignore[arg-type]
        assert sorted((x["user"], x["amount"]) for x in grabs) == sorted(  # type: ignore[type-var]
            (c.welcome["user"], r["amount"]) for c, r in zip(grabbers, got, strict=True)
        )
        assert ev["data"]["best_luck"]["amount"] == max(int(r["amount"]) for r in got)  # type: ignore[index]
        # Exactly once in the group's stream: one finished, each grab in one grabs event.
        from server.live import events

        kept = (await events.since(h.core, g, "0-0", 1_000)).events
        assert [k for _, k, _ in kept].count("finished") == 1
        listed = [x["user"] for _, k, d in kept if k == "grabs" for x in d["grabs"]]
        assert sorted(listed) == sorted(c.welcome["user"] for c in grabbers)
        assert "hub background task failed" not in caplog.text
        for c in (admin, *grabbers):
            await c.close()
