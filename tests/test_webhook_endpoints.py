"""Webhook endpoints of their own (``REDPACKET_WEBHOOK_ENDPOINTS``): each URL signed with its own secret
only, sent only the event types it takes, a bad list refused at start-up in one line; and the service
API's look at them and their deliveries, paged by the one convention, behind the service key."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import httpx

from server.settings import Settings
from tests.chatbackend import KEY, Backend
from tests.clitools import assert_one_line_error, redpacket
from tests.hubtools import eventually, hub_in_process
from tests.webhooktools import OWN, SECRET, Receiver, receiving, verifier


def test_a_bad_endpoints_setting_stops_every_command_at_start_up(tmp_path: Path) -> None:
    bad = tmp_path / "endpoints.json"
    bad.write_text(json.dumps([{"url": "https://a.example/h", "secret": OWN, "events": ["grab.won"]}]))
    done = redpacket("worker", REDPACKET_WEBHOOK_ENDPOINTS=str(bad), timeout=60)
    assert_one_line_error(done, 2, "REDPACKET_WEBHOOK_ENDPOINTS, entry 1 (a.example/h)", "'grab.won'")
    done = redpacket("worker", REDPACKET_WEBHOOK_ENDPOINTS=str(tmp_path / "none.json"), timeout=60)
    assert_one_line_error(done, 2, "neither a JSON list nor the path of a readable file")
    bad.write_text("[{")
    done = redpacket("webhooks", "status", REDPACKET_WEBHOOK_ENDPOINTS=str(bad), timeout=60)
    assert_one_line_error(done, 2, "does not hold JSON")


async def test_own_secrets_event_filters_and_the_deliveries_api(hub_settings: Settings) -> None:
    """A wallet receiver (its own secret, top-ups only) and a catch-all one (the default secret): each
    verifies with its secret only, the wallet gets no other type; the API lists both and pages each
    one's deliveries by the convention."""
    check = verifier()
    wallet = Receiver(verify=lambda _s, sig, body: check(OWN, sig, body) and not check(SECRET, sig, body))
    every = Receiver(verify=lambda _s, sig, body: check(SECRET, sig, body) and not check(OWN, sig, body))
    async with receiving(wallet), receiving(every):
        settings = hub_settings.replace(
            service_key=KEY,
            demo_topup=False,
            webhook_urls=every.url,
            webhook_secret=SECRET,
            webhook_endpoints=json.dumps([{"url": wallet.url, "secret": OWN, "events": ["account.topup"]}]),
            webhook_retry_ms=20,
        )
        async with hub_in_process(settings, run_worker=True) as hub:
            b = Backend(hub)
            base = random.randrange(10**12, 10**15)
            await b.ok("PUT", f"/api/service/users/{base}", name=f"e{base}")
            for i in range(3):
                await b.ok(
                    "POST", "/api/service/topup", user_id=base, amount=100 + i, request_id=f"e{base}{i}"
                )
            await b.ok("POST", "/api/service/withdraw", user_id=base, amount=50, request_id=f"e{base}w")
            pulled = await b.pulled()
            assert [e["type"] for e in pulled] == ["account.topup"] * 3 + ["account.withdrawn"]
            await eventually(lambda: len(every.accepted) == 4 and len(wallet.accepted) == 3, timeout=60)
            assert wallet.bad_signatures == every.bad_signatures == 0
            assert {e["type"] for e in wallet.accepted.values()} == {"account.topup"}

            hooks = await b.ok("GET", "/api/service/webhooks")
            assert hooks["more"] is False and hooks["next"] == 2
            assert [(h["position"], h["events"]) for h in hooks["webhooks"]] == [
                (1, None),
                (2, ["account.topup"]),
            ]
            assert not any(OWN in str(h) or SECRET in str(h) for h in hooks["webhooks"])
            first = await b.ok("GET", "/api/service/webhooks?limit=1")
            assert (len(first["webhooks"]), first["next"], first["more"]) == (1, 1, True)
            every_id, wallet_id = (h["id"] for h in hooks["webhooks"])

            async def all_delivered() -> bool:
                page = await b.ok("GET", f"/api/service/webhooks/{every_id}/deliveries?status=pending")
                return page["deliveries"] == []

            await eventually(all_delivered, timeout=60)
            got: list[dict[str, Any]] = []
            after = 0
            while True:  # two at a time, by the convention
                page = await b.ok("GET", f"/api/service/webhooks/{every_id}/deliveries?after={after}&limit=2")
                got += page["deliveries"]
                after = page["next"]
                if not page["more"]:
                    break
            assert [d["event_id"] for d in got] == [e["id"] for e in pulled]
            assert {(d["status"], d["attempts"], d["last_error"], d["next_try_ms"]) for d in got} == {
                ("delivered", 1, None, None)
            }
            empty = await b.ok("GET", f"/api/service/webhooks/{every_id}/deliveries?after={after}")
            assert empty == {"webhook": every_id, "deliveries": [], "next": after, "more": False}
            mine = await b.ok("GET", f"/api/service/webhooks/{wallet_id}/deliveries")
            assert [d["type"] for d in mine["deliveries"]] == ["account.topup"] * 3
            last = pulled[-1]["id"]
            one = await b.ok("GET", f"/api/service/webhooks/{every_id}/deliveries/{last}")
            assert (one["event_id"], one["type"], one["status"]) == (last, "account.withdrawn", "delivered")

            auth = {"authorization": f"Bearer {KEY}"}
            async with httpx.AsyncClient(base_url=hub.http, headers=auth) as http:
                refused = [
                    (f"/api/service/webhooks/{every_id}/deliveries?after={last + 5}", 400, "bad_request"),
                    (f"/api/service/webhooks/{every_id}/deliveries?status=lost", 400, "bad_request"),
                    (f"/api/service/webhooks/{every_id}/deliveries?limit=501", 400, "bad_request"),
                    ("/api/service/webhooks?after=3", 400, "bad_request"),
                    (f"/api/service/webhooks/{wallet_id}/deliveries/{last}", 404, "webhook_not_found"),
                    ("/api/service/webhooks/0123/deliveries", 404, "webhook_not_found"),
                ]
                for path, status, code in refused:
                    r = await http.get(path)
                    assert (r.status_code, r.json()["error"]["code"]) == (status, code), (path, r.text)
                for path in (
                    "/api/service/webhooks",
                    f"/api/service/webhooks/{every_id}/deliveries",
                    f"/api/service/webhooks/{every_id}/deliveries/{last}",
                ):
                    r = await http.get(path, headers={"authorization": "Bearer " + "x" * 40})
                    assert r.status_code == 401, path
