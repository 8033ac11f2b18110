"""Hubs as separate processes (``redpacket serve``): fan-out across processes, and SIGTERM draining."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from websockets.exceptions import ConnectionClosed

from redpacket_client.connection import HubClient
from redpacket_client.protocol import offset_key
from server.hub import protocol
from server.settings import Settings
from server.store import keys
from server.store.records import CreditEntry
from tests.conftest import TEST_NAMESPACE
from tests.hubtools import eventually, hub_process


@pytest.fixture(autouse=True)
def _keys_named_as_the_hubs_name_them() -> Iterator[None]:
    """Keys read here from outside are named under the deployment id the hubs read from their database
    (the tests'); without it they were so only when an earlier test of the run had opened a core."""
    keys.claim(TEST_NAMESPACE)
    try:
        yield
    finally:
        keys.release()


async def _members(h: Any, n: int, prefix: str) -> tuple[int, str, int, list[tuple[int, str]]]:
    admin, token = await h.login(f"{prefix}admin")
    await h.api("POST", "/api/topup", token, amount=1_000_000, request_id="seed")
    group = (await h.api("POST", "/api/groups", token, name="big"))["group_id"]
    people = [await h.login(f"{prefix}{i}") for i in range(n)]
    await h.api("POST", f"/api/groups/{group}/members", token, user_ids=[u for u, _ in people])
    return admin, token, group, people


async def _until_finished(c: HubClient, packet_id: int) -> list[tuple[str, str]]:
    seen = []
    while True:
        ev = await c.next_event(timeout=30)
        seen.append((str(ev["offset"]), str(ev["event"])))
        if ev["event"] == "finished" and ev["data"]["packet_id"] == packet_id:
            return seen


async def test_two_hubs_200_members_see_the_same_events_in_the_same_order(any_hub_settings: Settings) -> None:
    async with hub_process(any_hub_settings) as a, hub_process(any_hub_settings) as b:
        _, admin_token, group, people = await _members(a, 200, "p")
        admin = await HubClient.connect(a.ws, admin_token)
        clients = [await HubClient.connect((a if i % 2 else b).ws, t) for i, (_, t) in enumerate(people)]
        await admin.sync()
        await asyncio.gather(*(c.sync() for c in clients))
        sent = await admin.request("send", group=group, kind="lucky", total=10_000, count=10)
        # Ten grabbers, half on each hub.
        grabbers = clients[:10]
        results = await asyncio.gather(
            *(c.request("grab", group=group, packet=sent["packet_id"]) for c in grabbers)
        )
        assert sum(r["amount"] for r in results) == 10_000
        streams = await asyncio.gather(*(_until_finished(c, sent["packet_id"]) for c in [admin, *clients]))
        # From the packet on, every client saw the same events in the same order, none twice.
        tails = []
        for s in streams:
            start = next(i for i, (_, kind) in enumerate(s) if kind == "packet")
            tails.append(s[start:])
        assert all(t == tails[0] for t in tails)
        offsets = [o for o, _ in tails[0]]
        assert len(offsets) == len(set(offsets))
        assert sorted(offsets, key=offset_key) == offsets
        kinds = [k for _, k in tails[0]]
        assert kinds[0] == "packet" and kinds[-1] == "finished" and "grabs" in kinds
        for c in [admin, *clients]:
            await c.close()


async def test_sigterm_sends_1012_and_loses_no_grab_in_flight(hub_settings: Settings) -> None:
    async with hub_process(hub_settings) as a, hub_process(hub_settings) as b:
        _, admin_token, group, people = await _members(a, 60, "s")
        admin = await HubClient.connect(a.ws, admin_token)
        sent = await admin.request("send", group=group, kind="lucky", total=6_000, count=60)
        doomed = [await HubClient.connect(b.ws, t) for _, t in people]
        answered: list[dict[str, Any]] = []
        storm = [asyncio.create_task(_grab(c, group, sent["packet_id"], answered)) for c in doomed]
        await asyncio.sleep(0)  # let the storm start before the signal
        assert b.process is not None
        b.process.send_signal(signal.SIGTERM)
        await asyncio.gather(*storm)
        assert await asyncio.to_thread(b.process.wait, 30) == 0
        codes = {c.ws.close_code for c in doomed}
        assert codes == {protocol.CLOSE_RESTART}, codes
        # Every grab Redis recorded, answered or not, had its credit queued before the hub exited.
        core_grabs = await a_redis_grabs(hub_settings, group, sent["packet_id"])
        assert len(core_grabs) >= len(answered)
        assert sorted(core_grabs) == await queued_seqs(hub_settings, group, sent["packet_id"])
        for c in [admin, *doomed]:
            await c.close()


async def _grab(c: HubClient, group: int, packet_id: int, answered: list[dict[str, Any]]) -> None:
    """One grab of a storm whose hub is about to die: the answer if it comes."""
    try:
        answered.append(await c.request("grab", group=group, packet=packet_id, timeout=30))
    except (TimeoutError, ConnectionClosed):
        pass


async def a_redis_grabs(settings: Settings, group: int, packet_id: int) -> list[int]:
    from redis.asyncio import Redis

    r = Redis.from_url(settings.redis_url)
    try:
        raw = await r.hgetall(keys.packet_grabs(group_id=group, packet_id=packet_id))
    finally:
        await r.aclose()
    return [int(v.split(b":")[0]) for v in raw.values()]


async def queued_seqs(settings: Settings, group: int, packet_id: int) -> list[int]:
    """The seqs of the packet's credits waiting in its shard's outbox."""
    from redis.asyncio import Redis

    r = Redis.from_url(settings.redis_url)
    try:
        rows = await r.xrange(keys.outbox_for(group))
    finally:
        await r.aclose()
    parsed = [CreditEntry.parse(fields[b"c"]) for _, fields in rows]
    return sorted(c.seq for c in parsed if c.packet_id == packet_id)


async def _unpaid_in_redis(r: Any, group: int, packet_id: int) -> dict[int, tuple[int, int]]:
    """The packet's grabs Redis holds (user → (seq, amount)) whose credit still waits in the shard's
    outbox, unacknowledged: both read in one MULTI."""
    async with r.pipeline(transaction=True) as pipe:
        pipe.hgetall(keys.packet_grabs(group_id=group, packet_id=packet_id))
        pipe.xrange(keys.outbox_for(group))
        held, rows = await pipe.execute()
    queued = {(c.user_id, c.seq, c.amount) for c in (CreditEntry.parse(f[b"c"]) for _, f in rows)}
    unpaid = {}
    for user, record in held.items():
        seq, amount, _ = (int(x) for x in record.split(b":"))
        if (int(user), seq, amount) in queued:
            unpaid[int(user)] = (seq, amount)
    return unpaid


def _won(answered: list[dict[str, Any]]) -> dict[int, tuple[int, int]]:
    """user → (seq, amount) of every "won" reply."""
    return {int(a["user_id"]): (int(a["seq"]), int(a["amount"])) for a in answered if a["outcome"] == "won"}


async def test_a_hub_killed_mid_storm_loses_no_grab(hub_settings: Settings) -> None:
    """SIGKILL of a hub holding grabs in Redis not yet paid, with more grabs on their way: every grab
    Redis recorded is paid (its credit was queued in the same Lua call; the sweeper pays any whose credit
    is gone), and every "won" for what its grabber was told."""
    from redis.asyncio import Redis

    from server.core import open_core
    from server.money import settlement
    from server.money.reconcile import reconcile
    from tests.books import run_worker

    async with hub_process(hub_settings) as a, hub_process(hub_settings) as b:
        _, admin_token, group, people = await _members(a, 80, "k")
        admin = await HubClient.connect(a.ws, admin_token)
        sent = await admin.request("send", group=group, kind="lucky", total=8_000, count=80)
        pid = sent["packet_id"]
        doomed = [await HubClient.connect(b.ws, t) for _, t in people]
        answered: list[dict[str, Any]] = []
        r = Redis.from_url(hub_settings.redis_url)
        try:
            # First wave: until hub b holds grabs in Redis, told "won" and not paid (no worker runs
            # before the end: their credits wait in the outbox).
            first, rest = doomed[:20], doomed[20:]
            storm = [asyncio.create_task(_grab(c, group, pid, answered)) for c in first]

            async def told_and_unpaid() -> bool:
                unpaid = await _unpaid_in_redis(r, group, pid)
                return len(_won(answered)) >= 10 and _won(answered).items() <= unpaid.items()

            await eventually(told_and_unpaid, 30)
            unpaid = await _unpaid_in_redis(r, group, pid)
            assert len(unpaid) >= 10 and _won(answered).items() <= unpaid.items()
        finally:
            await r.aclose()
        # The rest of the storm (each task's first step writes its grab to the socket), then SIGKILL as
        # soon as hub b is at work on it: more grabs in Redis than the first wave can make. The look is
        # made with a blocking client on purpose: this loop runs nothing from the look to the kill, so
        # no answer of the second wave can reach its client first (an async look lost that race on a
        # loaded machine) and the kill is certain to land mid-storm.
        storm += [asyncio.create_task(_grab(c, group, pid, answered)) for c in rest]
        await asyncio.sleep(0)
        look = redis.Redis.from_url(hub_settings.redis_url)
        try:
            deadline = time.monotonic() + 30
            while (in_redis_at_kill := look.hlen(keys.packet_grabs(group_id=group, packet_id=pid))) <= len(
                first
            ):
                assert time.monotonic() < deadline, "hub b did not take the second wave"
            told_at_kill, answered_at_kill = _won(answered), len(answered)
            assert b.process is not None
            b.process.send_signal(signal.SIGKILL)
        finally:
            look.close()
        # Killed mid-storm: grabs in Redis that no client had heard of yet, and grabbers still waiting.
        assert answered_at_kill < in_redis_at_kill and answered_at_kill < len(doomed)
        await asyncio.gather(*storm)
        async with open_core(hub_settings) as core:
            held = await a_redis_grabs(hub_settings, group, pid)
            await settlement.sweep(core)
            await run_worker(core)
            rows = await core.db.fetchall(
                "SELECT user_id, seq, amount FROM grab_records WHERE packet_id = %s AND status = 'credited'",
                (pid,),
            )
            paid = {int(u): (int(q), int(m)) for u, q, m in rows}
            assert sorted(q for q, _ in paid.values()) == sorted(held)
            # Every "won" told before the kill is paid as told; so is any that arrived after it.
            assert len(told_at_kill) >= 10 and told_at_kill.items() <= paid.items()
            assert _won(answered).items() <= paid.items()
            assert (await reconcile(core)).ok
        for c in [admin, *doomed]:
            await c.close()


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


async def test_serve_workers_share_a_port_replace_a_dead_one_and_stop_together(
    hub_settings: Settings,
) -> None:
    async with hub_process(hub_settings, "--workers", "2") as h:
        assert h.process is not None
        supervisor = h.process.pid
        await eventually(lambda: len(_children(supervisor)) == 2, 30)
        _, token, group, people = await _members(h, 40, "w")
        # The kernel hands each connection to one of the two processes: connect until both hold some.
        clients: list[HubClient] = []
        hubs: dict[str, list[HubClient]] = {}
        for _, t in people:
            c = await h.client(t)
            clients.append(c)
            hubs.setdefault(str(c.welcome["hub"]), []).append(c)
        if len(hubs) < 2:  # all landed on one (possible on an idle machine): connect in parallel
            more = await asyncio.gather(*(h.client(t) for _, t in people))
            clients += more
            for c in more:
                hubs.setdefault(str(c.welcome["hub"]), []).append(c)
        assert len(hubs) == 2
        # One room across both processes: a chat from one is seen on the other, once.
        on_first, on_second = hubs.values()
        said = await on_first[0].request("chat", group=group, text="across processes")
        ev = await on_second[0].next_event(timeout=30)
        while ev["event"] != "chat":  # presence events of the members joining come first
            ev = await on_second[0].next_event(timeout=30)
        assert (ev["event"], ev["offset"], ev["data"]["text"]) == ("chat", said["offset"], "across processes")
        # kill -9 of one hub process: the supervisor starts another; the other's sockets stay up.
        victim = _children(supervisor)[0]
        os.kill(victim, signal.SIGKILL)
        await eventually(lambda: len(_children(supervisor)) == 2 and victim not in _children(supervisor), 30)
        survivors = [c for c in clients if c.ws.close_code is None]
        assert survivors, "the sockets of the process that was not killed stay open"
        await survivors[0].request("ping")
        replacement = await h.client(token)
        assert (await replacement.request("ping"))["ts"] > 0
        for c in [*clients, replacement]:
            await c.close()
        # SIGUSR1 to the supervisor (an operator telling the hubs to go back to their first database
        # node): passed on; it is not the end of it (the default action of SIGUSR1: its exit code below).
        h.process.send_signal(signal.SIGUSR1)
        after = await h.client(token)
        assert (await after.request("ping"))["ts"] > 0
        await after.close()
        # SIGTERM to the supervisor: every hub process drains and exits, and so does it, with 0.
        h.process.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(h.process.wait, 60) == 0
        assert _children(supervisor) == []
