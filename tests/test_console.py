"""The operators' console's API on a real hub: where it is served, who it lets in, and what support reads
from it — where a user's money is, whether a packet was fair, the state of the books."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest

from server.core import Core
from server.hub.console import api, books, sessions
from server.ids import GroupId, PacketId, UserId
from server.live.bots import list_blocks, run_detector
from server.money import deliveries, grabs, packets, settlement
from server.money.crediting import credit_many
from server.money.deliveries import endpoint_id
from server.money.ledger import now_ms
from server.settings import Settings
from server.store import keys
from server.store.records import CreditEntry
from tests.books import locked_tables, run_worker
from tests.conftest import make_world
from tests.hubtools import HubUnderTest, eventually, free_port, hub_in_process, redpacket_up
from tests.jwts import signed
from tests.repofiles import ROOT
from tests.test_hostile import _answer, _status_and_code
from tests.webhooktools import SECRET

KEY = "console-key-for-the-tests-0123456789abcdef"
HOOK = "https://backend.example/hooks"
MARKUP = '<img src=x onerror="window.__owned = 1"><b>hi</b>'


@pytest.fixture
async def ops(hub_settings: Settings) -> AsyncIterator[tuple[HubUnderTest, str]]:
    """A hub with the console on its metrics port, and that port's address."""
    port = free_port()
    settings = hub_settings.replace(
        metrics_port=port,
        console_key=KEY,
        service_key="s" * 40,
        dev_login=False,
        demo_topup=False,
        webhook_urls=HOOK,  # (no worker delivers here: the test queues what a worker would)
        webhook_secret=SECRET,
    )
    async with hub_in_process(settings) as h:
        yield h, f"http://127.0.0.1:{port}"


async def _sign_in(http: httpx.AsyncClient) -> dict[str, str]:
    r = await http.post("/api/console/session", json={"key": KEY})
    assert r.status_code == 200, r.text
    return {"authorization": f"Bearer {r.json()['token']}", "redpacket-ids": "string"}


async def test_the_console_is_beside_the_metrics_behind_its_own_key(ops: tuple[HubUnderTest, str]) -> None:
    h, base = ops
    async with httpx.AsyncClient(base_url=h.http, timeout=10) as public:
        for path in ("/console/", "/console/console.js"):
            assert (await public.get(path)).status_code == 404  # not on the port strangers reach
        r = await public.post("/api/console/session", json={"key": KEY})
        assert (r.status_code, r.json()["error"]["code"]) == (404, "not_found")
    async with httpx.AsyncClient(base_url=base, timeout=10) as http:
        page = await http.get("/console/")
        assert page.status_code == 200 and "operators' console" in page.text
        assert "script-src 'self'" in page.headers["content-security-policy"]
        assert (await http.get("/metrics")).status_code == 200  # the metrics still there
        user_token = signed(h.settings.secret)  # a user's token, good on the hub's own routes
        for bearer in (None, "s" * 40, user_token, KEY):  # nothing but a session: not even the key itself
            headers = {} if bearer is None else {"authorization": f"Bearer {bearer}"}
            r = await http.get("/api/console/books", headers=headers)
            assert (r.status_code, r.json()["error"]["code"]) == (401, "token_invalid"), bearer
        assert r.headers["cache-control"] == "no-store"
        expired = sessions.open_session(KEY, now_ms() - 3_600_000, 30)
        other = sessions.open_session("another-console-key-" + "x" * 20, now_ms(), 30)
        for token, code in ((expired.token, "token_expired"), (other.token, "token_invalid")):
            r = await http.get("/api/console/books", headers={"authorization": f"Bearer {token}"})
            assert (r.status_code, r.json()["error"]["code"]) == (401, code)
        good = await _sign_in(http)
        assert (await http.get("/api/console/books", headers=good)).status_code == 200
        # Wrong keys: 401 each, then 429 past the allowance (the right key still takes a session).
        # (Another X-Forwarded-For each time: trusted from no one unless REDPACKET_TRUSTED_PROXIES names it.)
        wrong = [{"x-forwarded-for": f"10.0.0.{i}"} for i in range(12)]
        codes = [
            (await http.post("/api/console/session", json={"key": "guess"}, headers=spoofed)).status_code
            for spoofed in wrong
        ]
        assert codes[0] == 401 and codes[-1] == 429, codes
        assert (await http.post("/api/console/session", json={"key": KEY})).status_code == 200


async def _grab(core: Core, packet: int, group: int, user: int) -> grabs.GrabResult:
    return await grabs.grab(core, packet_id=PacketId(packet), group_id=GroupId(group), user_id=UserId(user))


async def _story(core: Core) -> dict[str, Any]:
    """A finished packet with a grab paid, one waiting in the outbox and one the ledger refused; an
    expired packet refunded to its sender after one grab."""
    w = await make_world(core, members=3)
    fin = await packets.send_packet(
        core,
        sender_id=UserId(w.admin),
        group_id=GroupId(w.group),
        kind="lucky",
        total=900,
        count=3,
        greeting="恭喜发财",
    )
    paid = await _grab(core, fin.packet_id, w.group, w.members[0])
    assert await run_worker(core) == 1
    waiting = await _grab(core, fin.packet_id, w.group, w.members[1])
    refused = await _grab(core, fin.packet_id, w.group, w.members[2])
    g = refused.grab  # its credit, with an amount that is not the share's: the ledger refuses it for good
    assert await credit_many(
        core.db, [CreditEntry(fin.packet_id, g.user_id, g.seq, g.amount + 1, g.grabbed_ms)]
    ) == ["share_conflict"]
    old = await packets.send_packet(
        core,
        sender_id=UserId(w.admin),
        group_id=GroupId(w.group),
        kind="equal",
        total=300,
        count=3,
        greeting=MARKUP,  # text, never markup, wherever the console shows it
    )
    early = await _grab(core, old.packet_id, w.group, w.members[0])
    refund = await settlement.refund_packet(core, old.packet_id, now=old.expires_ms + 1)
    return {
        "w": w,
        "fin": fin,
        "paid": paid,
        "waiting": waiting,
        "refused": refused,
        "old": old,
        "early": early,
        "refund": refund,
    }


async def test_where_the_money_is_and_whether_the_packet_was_fair(ops: tuple[HubUnderTest, str]) -> None:
    h, base = ops
    s = await _story(h.core)
    fin, w = s["fin"], s["w"]
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        auth = await _sign_in(http)
        p = (await http.get(f"/api/console/packets/{fin.packet_id}", headers=auth)).json()
        assert p["packet_id"] == str(fin.packet_id) and p["sender_id"] == str(w.admin)  # ids as text
        assert (p["total"], p["count"], p["remaining"], p["greeting"]) == (900, 3, 0, "恭喜发财")
        states = {int(g["user_id"]): (g["credit"], g["refusal"]) for g in p["grabs"]}
        assert states == {
            w.members[0]: ("paid", None),
            w.members[1]: ("outbox", None),
            w.members[2]: (
                "refused",
                {"code": "share_conflict", "refused_by": "drain", "ms": states[w.members[2]][1]["ms"]},
            ),
        }
        assert [int(g["seq"]) for g in p["grabs"]] == sorted(int(g["seq"]) for g in p["grabs"])  # grab order
        assert p["paid"] == s["paid"].grab.amount
        assert p["fairness"]["status"] == "verified" and sum(p["fairness"]["shares"]) == 900
        kinds = [j["kind"] for j in p["journal"]]
        assert kinds == ["send", "grab"] and p["journal"][0]["amount"] == -900
        assert [e["type"] for e in p["events"]] == ["packet.sent", "share.credited"]  # the credit paid
        assert p["deliveries"] == []  # none queued yet: a worker queues them
        await deliveries.queue(h.core.db, endpoint_id(HOOK), now_ms())
        p = (await http.get(f"/api/console/packets/{fin.packet_id}", headers=auth)).json()
        sent = [(d["event_id"], d["endpoint"], d["status"]) for d in p["deliveries"]]
        assert sent == [(e["id"], "backend.example/hooks", "pending") for e in p["events"]]

        old = (await http.get(f"/api/console/packets/{s['old'].packet_id}", headers=auth)).json()
        assert old["status"] == "refunded" and old["refund"]["amount"] == 300 - s["early"].grab.amount
        assert [g["credit"] for g in old["grabs"]] == ["paid"]  # the refund paid the grab first
        assert old["fairness"]["status"] == "verified"

        u = (await http.get(f"/api/console/users/{w.admin}", headers=auth)).json()
        assert u["balance"] == u["journal_sum"] == 1_000_000 - 900 - 300 + old["refund"]["amount"]
        assert u["journal"][0]["balance_after"] == u["balance"]
        assert u["journal"][-1]["balance_after"] - u["journal"][-1]["amount"] == 0  # back to nothing

        # A share the database stored otherwise than its seed drew: the console says the proof fails.
        await h.core.db.fetchall(
            "UPDATE red_packet_shares SET amount = amount + 1 WHERE packet_id = %s AND seq = 1",
            (fin.packet_id,),
        )
        bad = (await http.get(f"/api/console/packets/{fin.packet_id}", headers=auth)).json()["fairness"]
        assert bad["problems"] and "stored share 1" in " ".join(bad["problems"])
        missing = await http.get("/api/console/packets/999999", headers=auth)
        assert (missing.status_code, missing.json()["error"]["code"]) == (404, "packet_not_found")


async def test_the_books_and_a_lifted_throttle(ops: tuple[HubUnderTest, str]) -> None:
    h, base = ops
    core = h.core
    s = await _story(core)
    from worker.settle import reconcile_job

    assert await reconcile_job({"core": core}) >= 1  # the refused credit is a difference until paid
    suspect = s["w"].members[1]
    now = now_ms()
    rows = [[suspect, s["w"].group, s["fin"].packet_id, 5, "", now]]  # a grab 5 ms after the packet showed
    await core.redis.xadd(keys.grab_attempts(), {"a": msgpack.packb(rows)})
    assert (await run_detector(core, now=now))[suspect].action == "throttle"
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        auth = await _sign_in(http)

        async def hub_seen() -> bool:
            b = (await http.get("/api/console/books", headers=auth)).json()
            return any(p["role"] == "hub" and p["id"] == h.hub.id for p in b["processes"])

        await eventually(hub_seen)
        b = (await http.get("/api/console/books", headers=auth)).json()
        rec = b["reconciliation"]
        assert rec["differences"] >= 1 and rec["report"]["differences"]
        assert any(str(s["fin"].packet_id) in d["subject"] for d in rec["report"]["differences"])
        # The three credits no drain has read (the grab waiting, the refused one's own entry, and the grab
        # the refund paid), all in the group's shard.
        assert b["outbox"]["waiting"] == [{"shard": keys.shard(GroupId(s["w"].group)), "entries": 3}]
        # The oldest waits since its grab (the outbox entry's id is the Redis time it was written).
        assert abs(b["outbox"]["oldest_ms"] - s["waiting"].grab.grabbed_ms) <= 5, (b["outbox"], s["waiting"])
        assert b["redis"] and all("address" in m for m in b["redis"])
        assert b["database"]["dialect"] == "mysql" and b["database"]["writer"]

        u = (await http.get(f"/api/console/users/{suspect}", headers=auth)).json()
        assert [r["action"] for r in u["restrictions"]] == ["throttle"]
        r = await http.post(f"/api/console/users/{suspect}/lift", headers=auth)
        assert r.json() == {"user_id": str(suspect), "lifted": True}
        assert await list_blocks(core) == []
        again = await http.post(f"/api/console/users/{suspect}/lift", headers=auth)
        assert again.json()["lifted"] is False

        live = (await http.get("/api/console/live", headers=auth)).json()
        assert live["credit_backlog"] == 3 and live["hub"] == h.hub.id and live["credit_lag_ms"] >= 0


async def test_the_operations_listener_holds_the_hubs_bounds(hub_settings: Settings) -> None:
    """The console's listener is the hub's HTTP with the hub's bounds: a request that never finishes is
    cut at the handshake deadline, a body or a head over the limits is refused before it is read, and
    every answer carries the hub's security headers."""
    port = free_port()
    settings = hub_settings.replace(metrics_port=port, console_key=KEY, handshake_seconds=1.0)
    async with hub_in_process(settings):
        silent = asyncio.create_task(_answer("127.0.0.1", port, b""))
        trickle = asyncio.create_task(_answer("127.0.0.1", port, b"GET /console/ HTTP/1.1\r\nHost: x\r\n"))
        for task in (silent, trickle):
            assert _status_and_code(await task) == (408, "request_timeout")
        head = b"POST /api/console/session HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        answer = await _answer("127.0.0.1", port, head + b"Content-Length: 157286400\r\n\r\n")
        assert _status_and_code(answer) == (413, "request_too_large"), answer[:200]
        many = "".join(f"X-{i}: y\r\n" for i in range(65)).encode()
        answer = await _answer("127.0.0.1", port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n")
        assert _status_and_code(answer) == (431, "request_too_large"), answer[:200]
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            for r in (await http.get("/console/console.js"), await http.get("/api/console/live")):
                assert (
                    r.headers["x-frame-options"] == "DENY"
                    and r.headers["x-content-type-options"] == "nosniff"
                )
                assert "frame-ancestors 'none'" in r.headers["content-security-policy"]
            assert (await http.get("/console")).headers["location"] == "/console/"
            assert (await http.get("/metrics")).status_code == 200  # fine afterwards


def test_up_with_the_documented_settings_serves_the_console(tmp_path: Path) -> None:
    """docs/operations.md's recipe (another metrics port: 9100 may be taken here): `redpacket up` says
    where the console is, and it takes the key it was given — and nothing else."""
    text = (ROOT / "docs" / "operations.md").read_text().split("## The console", 1)[1]
    recipe = text.split("```sh\n", 1)[1].split("```", 1)[0]
    assert "REDPACKET_CONSOLE_KEY=$(openssl rand -hex 32) REDPACKET_METRICS_PORT=9100" in recipe
    port, key = free_port(), "k" * 64
    said: list[str] = []
    with redpacket_up(
        tmp_path, env={"REDPACKET_CONSOLE_KEY": key, "REDPACKET_METRICS_PORT": str(port)}, said=said
    ):
        where = f"http://127.0.0.1:{port}/console/"

        def printed() -> bool:
            return any(f"operators' console on {where}" in line for line in said)

        asyncio.run(eventually(printed))
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            assert http.get("/console/").status_code == 200
            assert http.post("/api/console/session", json={"key": "k" * 63}).status_code == 401
            token = http.post("/api/console/session", json={"key": key}).json()["token"]
            books = http.get("/api/console/books", headers={"authorization": f"Bearer {token}"}).json()
            assert books["database"]["dialect"] == "sqlite" and books["outbox"]["total"] == 0


async def test_the_console_on_the_hubs_port_when_asked(hub_settings: Settings) -> None:
    """REDPACKET_CONSOLE_ON_HUB_PORT=1 and no metrics port: the console is on the hub's port, as behind it."""
    settings = hub_settings.replace(console_key=KEY, console_on_hub_port=True)
    async with hub_in_process(settings) as h, httpx.AsyncClient(base_url=h.http, timeout=10) as http:
        assert (await http.get("/console/")).status_code == 200
        assert (await http.get("/api/console/books")).status_code == 401
        auth = await _sign_in(http)
        assert (await http.get("/api/console/live", headers=auth)).json()["hub"] == h.hub.id


async def test_a_stalled_ledger_is_a_503_in_seconds_and_the_books_say_which_part(
    ops: tuple[HubUnderTest, str],
) -> None:
    """Another session holds the journal and the writer's table: a user's page is answered 503 within its
    bound, and the books show every part they could read, the database's saying why it is missing."""
    h, base = ops
    w = await make_world(h.core, members=1)
    with locked_tables(h.settings.database_url, "journal", "accounts", "db_writer"):
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            auth = await _sign_in(http)
            started = time.monotonic()
            r = await http.get(f"/api/console/users/{w.admin}", headers=auth)
            assert r.status_code == 503 and r.json()["error"]["code"] == "database_unavailable", r.text
            assert time.monotonic() - started < api.ANSWER_SECONDS + 3
            started = time.monotonic()
            b = (await http.get("/api/console/books", headers=auth)).json()
            assert time.monotonic() - started < books.PART_SECONDS + 3
            assert "error" in b["database"] and b["outbox"]["total"] == 0  # Redis's parts still read
