"""Webhook endpoints of their own (``REDPACKET_WEBHOOK_ENDPOINTS``): each URL signed with its own secret
only, sent only the event types it takes, a bad list refused at start-up in one line; and the service
API's look at them and their deliveries, paged by the one convention, behind the service key."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from server.money.endpoints import configured
from server.settings import Settings
from tests.hubtools import eventually, hub_in_process
from tests.test_cli import assert_one_line_error, redpacket
from tests.test_webhooks import GUIDE, KEY, SECRET, Backend, Receiver, receiving, verifier

OWN = "own-secret-of-the-wallet-receiver-0123456789"
OTHER = "another-secret-of-a-receiver-012345678901"


def listed(*entries: dict[str, Any], **settings: Any) -> Settings:
    return Settings(webhook_endpoints=json.dumps(list(entries)), **settings)


@pytest.mark.unit
def test_the_guides_endpoints_file_is_taken_as_written(tmp_path: Path) -> None:
    m = re.search(r"<!-- webhook-endpoints -->\n```json\n(.*?)```", GUIDE.read_text(), re.DOTALL)
    assert m
    (tmp_path / "endpoints.json").write_text(m[1])
    found = configured(Settings(webhook_endpoints=str(tmp_path / "endpoints.json")))
    assert [e.label for e in found] == [
        "wallet.example.com/hooks/redpacket",
        "chat.example.com/hooks/packets",
    ]
    assert found[0].events is not None and "share.credited" not in found[0].events
    assert found[1].secret_previous and not found[0].secret_previous


@pytest.mark.unit
def test_each_url_has_its_secret_or_the_defaults() -> None:
    s = listed(
        {"url": "https://a.example/h", "secret": OWN, "secret_previous": OTHER},
        {"url": "https://b.example/h", "events": ["account.topup"]},
        webhook_urls="https://c.example/h",
        webhook_secret=SECRET,
        webhook_secret_previous=OTHER,
    )
    c, a, b = configured(s)
    assert (c.url, c.secret, c.secret_previous, c.events) == ("https://c.example/h", SECRET, OTHER, None)
    assert (a.secret, a.secret_previous, a.events) == (OWN, OTHER, None)
    assert (b.secret, b.secret_previous, b.events) == (SECRET, OTHER, ("account.topup",))
    assert OWN not in repr(a) and SECRET not in repr(b)  # (a traceback's locals, a debug print)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("entries", "words"),
    [
        ([{"url": "https://a.example/h", "secret": OWN, "event": ["account.topup"]}], "unknown key 'event'"),
        ([{"url": "https://a.example/h", "secret": OWN, "events": ["share.credit"]}], "share.credited?"),
        ([{"url": "https://a.example/h", "secret": OWN, "events": []}], "events is a list"),
        ([{"url": "https://a.example/h", "secret_previous": OWN}], "secret_previous"),
        ([{"url": "https://a.example/h", "secret": OWN, "secret_previous": OWN}], "secret_previous"),
        ([{"url": "https://a.example/h", "secret": "short"}], "at least 32"),
        ([{"url": "https://a.example/h"}], "no secret"),
        ([{"url": "http://a.example/h?token=tok-1234", "secret": OWN}], "https://"),
        ([{"url": "https://a.example/h", "secret": OWN}] * 2, "named twice"),
        ([{"secret": OWN}], "needs a url"),
        (["https://a.example/h"], "an object"),
        # One object, not a list: before, taken for a file's path and quoted whole, secrets and all.
        ({"url": "https://a.example/h?token=tok-1234", "secret": OWN}, "a JSON list of"),
    ],
)
def test_a_bad_entry_is_refused_saying_which_and_no_secret(entries: Any, words: str) -> None:
    with pytest.raises(ValueError, match=re.escape(words)) as caught:
        configured(Settings(webhook_endpoints=json.dumps(entries)))
    said = str(caught.value)
    assert said.startswith("REDPACKET_WEBHOOK_ENDPOINTS") and "\n" not in said
    assert OWN not in said and "tok-1234" not in said and "short" not in said.replace("shorter", "")


@pytest.mark.unit
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
