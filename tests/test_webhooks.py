"""Webhooks, end to end: a real hub and worker, a real receiver over HTTP that fails for a while (500s,
then answers too late), then accepts. Every event arrives, each id once after dedupe, equal to what the
events API serves, in order per user, every signature checked with the receiver code docs/integration.md
gives (Python and JavaScript); a worker killed mid-delivery loses nothing; two dispatchers never both
acknowledge one delivery."""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from server.core import Core, open_core
from server.money import deliveries, events, ledger, packets
from server.money.crediting import credit_many
from server.money.reconcile import reconcile
from server.settings import Settings
from server.store.records import CreditEntry
from tests.chatbackend import KEY, Backend
from tests.clitools import assert_one_line_error, redpacket
from tests.hubtools import eventually, hub_in_process, worker_env
from tests.repofiles import guide_example
from tests.webhooktools import SECRET, Receiver, hooked, receiving, verifier, webhook_schema
from worker.webhooks import Dispatcher, sign


async def _money_story(b: Backend, base: int) -> None:
    """Top-ups, a withdrawal, a hold confirmed, a hold released, a packet sent and grabbed to the end."""
    for n in range(3):
        await b.ok("PUT", f"/api/service/users/{base + n}", name=f"w{base + n}")
        await b.ok("POST", "/api/service/topup", user_id=base + n, amount=5_000, request_id=f"t{base}-{n}")
    await b.ok("POST", "/api/service/withdraw", user_id=base, amount=700, request_id=f"w{base}")
    await b.ok("POST", "/api/service/holds", user_id=base + 1, amount=300, request_id=f"h{base}-a")
    await b.ok("POST", "/api/service/holds/confirm", request_id=f"h{base}-a")
    await b.ok("POST", "/api/service/holds", user_id=base + 2, amount=400, request_id=f"h{base}-b")
    await b.ok("POST", "/api/service/holds/release", request_id=f"h{base}-b")
    await b.ok(
        "PUT", f"/api/service/groups/{base}", name="g", version=1, admins=[base], members=[base + 1, base + 2]
    )
    core = b.hub.core
    p = await packets.send_packet(core, sender_id=base, group_id=base, kind="equal", total=600, count=2)
    await credit_many(core.db, [CreditEntry(p.packet_id, base + 1 + i, i + 1, 300, 1) for i in range(2)])


async def test_every_event_arrives_once_signed_in_order_through_500s_and_timeouts(
    hub_settings: Settings,
) -> None:
    async with receiving(Receiver(script=["500"] * 6 + ["slow"] * 2)) as rx:
        async with hub_in_process(hooked(hub_settings, rx), run_worker=True) as hub:
            b = Backend(hub)
            base = random.randrange(10**12, 10**15)
            await _money_story(b, base)
            pulled = await b.pulled()
            assert [e["type"] for e in pulled].count("share.credited") == 2
            assert len(pulled) == 3 + 1 + 2 + 2 + 1 + 2 + 1  # top-ups, out, holds, packet, credits, end
            await eventually(lambda: set(rx.accepted) == {e["id"] for e in pulled}, timeout=60)
            # Failures happened first, as scripted: 500s, then answers the dispatcher gave up waiting for.
            hows = [h for _, h in rx.seen]
            assert hows[:8] == ["500"] * 6 + ["slow"] * 2 and hows.count("ok") >= len(pulled)
            assert rx.bad_signatures == 0
            assert [rx.accepted[e["id"]] for e in pulled] == pulled  # the same bodies as the pull API
            described = webhook_schema()
            for event in pulled:  # each as docs/openapi.json's webhook describes it
                jsonschema.Draft202012Validator(described).validate(event)
            by_user: dict[int, list[int]] = defaultdict(list)
            for seq in rx.order:
                by_user[rx.accepted[seq]["user_id"]].append(seq)
            assert all(ids == sorted(ids) for ids in by_user.values()), by_user  # in order per user
            report = await reconcile(hub.core)
            assert report.ok, report.differences
            assert report.paid_out == 700 + 300


async def test_a_worker_killed_mid_delivery_loses_nothing(hub_settings: Settings, tmp_path: Path) -> None:
    """The receiver holds the first delivery open; the worker sending it is killed (-9); another worker
    delivers it once the first one's lease is over, and every other event too."""
    async with receiving(Receiver(script=["hold"])) as rx:
        settings = hooked(hub_settings, rx)
        async with hub_in_process(settings) as hub:  # no worker beside: the processes below are the workers
            b = Backend(hub)
            base = random.randrange(10**12, 10**15)
            for n in range(4):
                await b.ok("PUT", f"/api/service/users/{base + n}", name=f"k{base + n}")
                await b.ok(
                    "POST", "/api/service/topup", user_id=base + n, amount=100 + n, request_id=f"k{base}{n}"
                )
            env = {
                **worker_env(settings),
                "REDPACKET_WEBHOOK_URLS": rx.url,
                "REDPACKET_WEBHOOK_SECRET": SECRET,
                "REDPACKET_WEBHOOK_RETRY_MS": "20",
                "REDPACKET_WEBHOOK_TIMEOUT_MS": "400",
            }
            workers = []
            try:
                workers.append(_worker(env, tmp_path / f"worker{len(workers)}.log"))
                await asyncio.wait_for(rx.holding.wait(), 60)  # a delivery in flight: the dangerous state
                held = rx.seen[0][0]
                workers[0].send_signal(signal.SIGKILL)
                await asyncio.to_thread(workers[0].wait, 30)
                assert held not in rx.accepted
                rx.release.set()
                workers.append(_worker(env, tmp_path / f"worker{len(workers)}.log"))
                pulled = await b.pulled()

                async def all_acknowledged() -> bool:
                    row = await hub.core.db.fetchone(
                        "SELECT COUNT(*) FROM webhook_deliveries WHERE state = 'delivered'"
                    )
                    return row is not None and int(row[0]) == len(pulled)

                await eventually(all_acknowledged, timeout=60)
                assert set(rx.accepted) == {e["id"] for e in pulled}
                # The held one was sent again by the second worker once the first one's lease was over
                # (the receiver answered the dead worker's request too late for it to hear).
                assert [seq for seq, _ in rx.seen].count(held) >= 2
            finally:
                for w in workers:
                    w.kill()
                    await asyncio.to_thread(w.wait, 30)


def _worker(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen([sys.executable, "-m", "server", "worker"], env=env, stdout=out, stderr=out)


@pytest.mark.parametrize("core", ["mysql"], indirect=True)
async def test_a_receiver_that_does_not_answer_delays_no_other_url(core: Core) -> None:
    """Before: one round went over the URLs one after another, so a receiver holding its answer held back
    every other URL's deliveries until its timeout. Now each URL has a loop of its own."""
    async with receiving(Receiver(script=["hold"])) as stuck, receiving(Receiver()) as fine:
        settings = core.settings.replace(
            webhook_urls=f"{stuck.url},{fine.url}", webhook_secret=SECRET, webhook_timeout_ms=120_000
        )
        user = await ledger.create_user(core.db, "stuck")
        async with open_core(settings) as c:
            dispatcher = asyncio.create_task(Dispatcher(c).run())
            try:
                for i in range(3):
                    await ledger.topup(core.db, user, 10 + i, f"s{i}")
                await asyncio.wait_for(stuck.holding.wait(), 30)  # the state: a delivery held unanswered
                await eventually(lambda: len(fine.accepted) == 3, 30)
                assert not stuck.release.is_set() and stuck.seen[0][1] == "hold"
            finally:
                dispatcher.cancel()
                await asyncio.gather(dispatcher, return_exceptions=True)


async def test_two_dispatchers_never_both_acknowledge_one_delivery(core: Core) -> None:
    """Two dispatchers race over 120 events of 12 users: each delivery is acknowledged by one of them,
    and with no failure each event is sent once."""
    async with receiving(Receiver()) as rx:
        settings = core.settings.replace(webhook_urls=rx.url, webhook_secret=SECRET, webhook_timeout_ms=2000)
        users = [await ledger.create_user(core.db, f"d{i}") for i in range(12)]
        async with open_core(settings) as a, open_core(settings) as b:
            ones = [Dispatcher(a), Dispatcher(b)]
            for i in range(120):
                await ledger.topup(core.db, users[i % 12], 10 + i, f"r{i}")
            acked: list[int] = []
            real_ack = deliveries.ack

            async def counting_ack(*args: Any, **kw: Any) -> bool:
                won = await real_ack(*args, **kw)
                if won:
                    acked.append(args[2])
                return won

            deliveries.ack = counting_ack  # type: ignore[assignment]
            try:
                async with httpx.AsyncClient() as http:
                    for d in ones:
                        d.client = http

                    async def until_done(d: Dispatcher) -> None:
                        while len(rx.accepted) < 120:
                            await d.round()

                    await asyncio.wait_for(asyncio.gather(*(until_done(d) for d in ones)), 120)
            finally:
                deliveries.ack = real_ack  # type: ignore[assignment]
            assert len(acked) == len(set(acked)) == 120
            assert len(rx.seen) == 120  # each sent once
            assert (
                sum(
                    d.metrics.webhooks.deliveries.labels(label(rx.url), "delivered")._value.get()
                    for d in ones
                )
                == 120
            )


def label(url: str) -> str:
    from worker.webhooks import label as label_of

    return label_of(url)


def _signed(t: int, body: bytes = b'{"id":1}') -> str:
    return sign(SECRET, body, t)


def test_the_documented_check_refuses_old_future_forged_and_altered_deliveries() -> None:
    verify = verifier()
    now = int(time.time())
    body = b'{"id":1}'
    assert verify(SECRET, _signed(now), body)
    assert verify(SECRET, _signed(now - 290), body)
    assert not verify(SECRET, _signed(now - 310), body)  # a replay, or a delivery held 5 minutes
    assert not verify(SECRET, _signed(now + 310), body)  # a clock too far ahead
    assert not verify(SECRET, _signed(now), b'{"id":2}')  # the body changed on the way
    assert not verify("another-secret-of-the-same-length-0123456789", _signed(now), body)
    for header in ["", "t=x,v1=00", f"t={now}", "v1=00", f"t={now},v1=zz"]:
        assert not verify(SECRET, header, body), header


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node")
def test_the_javascript_check_agrees_with_the_python_one(tmp_path: Path) -> None:
    (tmp_path / "verify.mjs").write_text(guide_example("webhook-verify-js"))
    now = int(time.time())
    body = '{"id":1,"data":{"name":"王"}}'
    cases = [
        (_signed(now, body.encode()), body),
        (_signed(now - 310, body.encode()), body),
        (_signed(now + 310, body.encode()), body),
        (_signed(now, body.encode()), body.replace("1", "2")),
        ("t=1,v1=", body),
        ("", body),
    ]
    (tmp_path / "run.mjs").write_text(
        "import { verifyWebhook } from './verify.mjs';\n"
        f"const cases = {json.dumps(cases)};\n"
        f"console.log(JSON.stringify(cases.map(([s, b]) => verifyWebhook({json.dumps(SECRET)}, s, b))));\n"
    )
    done = subprocess.run(["node", "run.mjs"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    verify = verifier()
    assert (
        json.loads(done.stdout)
        == [verify(SECRET, s, b.encode()) for s, b in cases]
        == [
            True,
            False,
            False,
            False,
            False,
            False,
        ]
    )


async def test_the_events_api_pages_and_refuses_bad_cursors(hub_settings: Settings) -> None:
    async with hub_in_process(hub_settings.replace(service_key=KEY, demo_topup=False)) as hub:
        b = Backend(hub)
        base = random.randrange(10**12, 10**15)
        await b.ok("PUT", f"/api/service/users/{base}", name=f"p{base}")
        for i in range(5):
            await b.ok("POST", "/api/service/topup", user_id=base, amount=1 + i, request_id=f"p{base}{i}")
        first = await b.ok("GET", "/api/service/events?after=0&limit=2")
        assert [e["data"]["amount"] for e in first["events"]] == [1, 2] and first["more"]
        rest = await b.ok("GET", f"/api/service/events?after={first['next']}")
        assert [e["data"]["amount"] for e in rest["events"]] == [3, 4, 5] and not rest["more"]
        empty = await b.ok("GET", f"/api/service/events?after={rest['next']}")
        assert empty == {"events": [], "next": rest["next"], "more": False}
        async with httpx.AsyncClient(base_url=hub.http) as http:
            for query in ["after=-1", "limit=0", "limit=501", "after=x", "after=9223372036854775808"]:
                r = await http.get(f"/api/service/events?{query}", headers={"authorization": f"Bearer {KEY}"})
                assert (r.status_code, r.json()["error"]["code"]) == (400, "bad_request"), query
            r = await http.get("/api/service/events")
            assert r.status_code == 401


def test_settings_refuse_webhooks_without_a_secret_or_over_plain_http() -> None:
    with pytest.raises(ValueError, match="WEBHOOK_SECRET"):
        Settings(webhook_urls="https://backend.example/hooks").check()
    with pytest.raises(ValueError, match="WEBHOOK_URLS"):
        Settings(webhook_urls="http://backend.example/hooks", webhook_secret=SECRET).check()
    fine = Settings(webhook_urls="http://127.0.0.1:9/h, https://b.example/h,", webhook_secret=SECRET)
    fine.check()
    assert fine.webhook_url_list == ("http://127.0.0.1:9/h", "https://b.example/h")


async def test_replay_sends_events_again_and_status_says_how_far_each_url_is(hub_settings: Settings) -> None:
    """``redpacket webhooks replay`` makes delivered events due again (same ids), from an id or a time;
    ``status`` counts what is undelivered; an operator's mistake is one line."""

    async with receiving(Receiver()) as rx:
        settings = hooked(hub_settings, rx)
        async with hub_in_process(settings, run_worker=True) as hub:
            b = Backend(hub)
            base = random.randrange(10**12, 10**15)
            await b.ok("PUT", f"/api/service/users/{base}", name=f"r{base}")
            for i in range(3):
                await b.ok("POST", "/api/service/topup", user_id=base, amount=1 + i, request_id=f"r{base}{i}")
            pulled = await b.pulled()
            await eventually(lambda: len(rx.seen) == 3, timeout=60)
            env = {
                "REDPACKET_DATABASE_URL": settings.database_url,
                "REDPACKET_REDIS_URL": settings.redis_url,
                "REDPACKET_WEBHOOK_URLS": rx.url,
                "REDPACKET_WEBHOOK_SECRET": SECRET,
            }
            done = await asyncio.to_thread(
                redpacket, "webhooks", "replay", "--after", str(pulled[0]["id"]), **env
            )
            assert done.returncode == 0, done.stderr
            assert done.stdout.startswith("2 deliveries of events after id"), done.stdout
            await eventually(lambda: len(rx.seen) == 5, timeout=60)
            assert [seq for seq, _ in rx.seen] == [e["id"] for e in pulled] + [e["id"] for e in pulled[1:]]
            done = await asyncio.to_thread(
                redpacket, "webhooks", "replay", "--since", "2000-01-01T00:00Z", **env
            )
            assert done.returncode == 0 and done.stdout.startswith("3 deliveries"), done.stdout + done.stderr
            await eventually(lambda: len(rx.seen) == 8, timeout=60)
            done = await asyncio.to_thread(redpacket, "webhooks", "status", **env)
            shown = f"{label(rx.url)} ({deliveries.endpoint_id(rx.url)})"  # never the URL's secrets
            assert (
                done.returncode == 0 and done.stdout.strip() == f"{shown}: 0 pending (oldest none), 0 failed"
            )
            other = {**env, "REDPACKET_WEBHOOK_URLS": "https://other.example/hooks"}
            done = await asyncio.to_thread(redpacket, "webhooks", "status", **other)
            said = "no worker has run with this URL yet (nothing queued for it)"
            shown = f"other.example/hooks ({deliveries.endpoint_id('https://other.example/hooks')})"
            assert done.stdout.strip() == f"{shown}: {said}", done.stdout + done.stderr
            bad = await asyncio.to_thread(redpacket, "webhooks", "replay", "--since", "yesterday", **env)
            assert_one_line_error(bad, 2, "ISO 8601")
            off = {**env, "REDPACKET_WEBHOOK_URLS": ""}
            assert_one_line_error(
                await asyncio.to_thread(redpacket, "webhooks", "status", **off), 2, "WEBHOOK_URLS"
            )


async def test_money_out_over_http_answers_each_mistake_with_its_code(hub_settings: Settings) -> None:
    async with hub_in_process(hub_settings.replace(service_key=KEY, demo_topup=False)) as hub:
        b = Backend(hub)
        base = random.randrange(10**12, 10**15)
        await b.ok("PUT", f"/api/service/users/{base}", name=f"m{base}")
        await b.ok("POST", "/api/service/topup", user_id=base, amount=1_000, request_id=f"m{base}")

        async def call(path: str, **body: Any) -> tuple[int, Any]:
            async with httpx.AsyncClient(base_url=hub.http) as http:
                r = await http.post(path, json=body, headers={"authorization": f"Bearer {KEY}"})
            return r.status_code, r.json()

        answers = await asyncio.gather(
            *(
                call("/api/service/withdraw", user_id=base, amount=600, request_id=f"x{base}")
                for _ in range(6)
            )
        )
        assert sorted(a["replay"] for _, a in answers) == [False] + [True] * 5
        assert {a["balance"] for _, a in answers} == {400}
        for path, body, status, code in [
            (
                "/api/service/withdraw",
                {"user_id": base, "amount": 401, "request_id": "y"},
                409,
                "insufficient_funds",
            ),
            (
                "/api/service/withdraw",
                {"user_id": base, "amount": "1", "request_id": "y"},
                400,
                "amount_invalid",
            ),
            ("/api/service/withdraw", {"user_id": base, "amount": 1}, 400, "bad_request"),
            (
                "/api/service/withdraw",
                {"user_id": base + 1, "amount": 1, "request_id": "y"},
                404,
                "user_not_found",
            ),
            (
                "/api/service/withdraw",
                {"user_id": base, "amount": 5, "request_id": f"x{base}"},
                409,
                "idempotency_key_reused",
            ),
            (
                "/api/service/holds",
                {"user_id": base, "amount": 401, "request_id": "h"},
                409,
                "insufficient_funds",
            ),
            (
                "/api/service/holds",
                {"user_id": base, "amount": 1, "request_id": "h", "expires_in_s": 5},
                400,
                "bad_request",
            ),
            ("/api/service/holds/confirm", {"request_id": "nope"}, 404, "hold_not_found"),
        ]:
            got, answer = await call(path, **body)
            assert (got, answer["error"]["code"]) == (status, code), (path, body)
        held = await b.ok("POST", "/api/service/holds", user_id=base, amount=100, request_id="h")
        assert (held["state"], held["balance"], held["closed_ms"]) == ("held", 300, None)
        await b.ok("POST", "/api/service/holds/release", request_id="h")
        got, answer = await call("/api/service/holds/confirm", request_id="h")
        assert (got, answer["error"]["code"], answer["error"]["state"]) == (409, "hold_closed", "released")
        assert (await b.ok("GET", f"/api/service/accounts/{base}"))["balance"] == 400
        assert (await reconcile(hub.core)).ok


@pytest.mark.parametrize("core", ["mysql"], indirect=True)
async def test_a_delivery_failing_past_the_give_up_time_is_failed_and_replay_sends_it(core: Core) -> None:
    """A receiver that keeps failing: once the delivery's event is older than the give-up time, the
    delivery is ``failed`` (counted, and no longer holding the user's later events back); a replay sends
    it again."""
    async with receiving(Receiver(script=["500"] * 1000)) as rx:
        settings = core.settings.replace(
            webhook_urls=rx.url, webhook_secret=SECRET, webhook_retry_ms=1, webhook_timeout_ms=2000
        )
        user = await ledger.create_user(core.db, "failing")
        await ledger.topup(core.db, user, 10, "first")
        async with open_core(settings) as c, httpx.AsyncClient() as http:
            d = Dispatcher(c, client=http)

            async def until(check: Callable[[], Any]) -> None:
                async def rounds() -> None:
                    while not await check():
                        await d.round()

                await asyncio.wait_for(rounds(), 60)

            async def state() -> deliveries.QueueState:
                return await deliveries.state(c.db, deliveries.endpoint_id(rx.url))

            await until(lambda: _true(len(rx.seen) >= 2))  # failed twice: the dangerous state
            assert (await state()).pending == 1 and not rx.accepted
            await ledger.topup(core.db, user, 20, "second")  # held back behind the first, in order
            hours = settings.webhook_give_up_hours * 3_600_000 + 1
            first = rx.seen[0][0]
            await c.db.run(  # the first one's event three days old (time passing, without waiting for it)
                lambda tx: tx.execute(
                    "UPDATE webhook_deliveries SET first_ms = first_ms - %s WHERE seq = %s", (hours, first)
                ),
                idempotent=True,
            )

            async def gave_up() -> bool:
                return (await state()).failed == 1

            await until(gave_up)
            name = label(rx.url)
            assert d.metrics.webhooks.deliveries.labels(name, "failed")._value.get() == 1
            rx.script.clear()  # the receiver is back
            await until(lambda: _true(len(rx.accepted) == 1))  # the later event is no longer held back
            assert [e["data"]["amount"] for e in rx.accepted.values()] == [20]
            n = await deliveries.replay(c.db, [deliveries.endpoint_id(rx.url)], 0, ledger.now_ms())
            assert n == 2

            async def all_delivered() -> bool:
                return (await state()) == deliveries.QueueState(0, 0, None)

            await until(all_delivered)  # both again, in order: the given-up one, then the other
            assert sorted(e["data"]["amount"] for e in rx.accepted.values()) == [10, 20]
            resent = [seq for seq, how in rx.seen if how == "ok"]
            assert resent[-2:] == sorted(resent[-2:]) and len(resent) == 3


async def _true(value: bool) -> bool:
    return value


@pytest.mark.parametrize("core", ["mysql"], indirect=True)
async def test_an_answer_after_the_lease_passed_to_another_dispatcher_acknowledges_nothing(
    core: Core,
) -> None:
    user = await ledger.create_user(core.db, "leased")
    await ledger.topup(core.db, user, 10, "one")
    endpoint = deliveries.endpoint_id("https://backend.example/hooks")
    await events.sequence(core.db)
    now = ledger.now_ms()
    await deliveries.queue(core.db, endpoint, now)  # the URL's queue, from the first event
    assert await deliveries.queue(core.db, endpoint, now) == 0
    first, claimed = await deliveries.claim(core.db, endpoint, now, 1_000, 10)
    assert [c.event["type"] for c in claimed] == ["account.topup"]
    assert (await deliveries.claim(core.db, endpoint, now + 999, 1_000, 10))[1] == []  # leased
    second, again = await deliveries.claim(core.db, endpoint, now + 1_000, 1_000, 10)  # the lease passed
    assert [c.seq for c in again] == [c.seq for c in claimed] and again[0].attempts == 2
    assert await deliveries.ack(core.db, endpoint, claimed[0].seq, first, now + 1_500) is False
    assert await deliveries.ack(core.db, endpoint, claimed[0].seq, second, now + 1_500) is True
    assert await deliveries.ack(core.db, endpoint, claimed[0].seq, second, now + 1_600) is False
