"""What generic HTTP tooling expects of every answer, on a live hub: a 429 says when to come back
(``Retry-After``, ``RateLimit-*``), a 405 says what the path takes (``Allow``), nothing of the API is kept
by a cache, ``Idempotency-Key`` is a ``request_id``, and every answer names its request."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import httpx
import pytest

from server.settings import Settings
from tests.chatbackend import KEY, Backend
from tests.hubtools import HubUnderTest, hub_in_process


@pytest.fixture
async def hub(hub_settings: Settings) -> AsyncIterator[HubUnderTest]:
    tight = hub_settings.replace(
        service_key=KEY, demo_topup=False, http_per_user_per_second=0.01, http_per_user_burst=3
    )
    async with hub_in_process(tight) as h:
        yield h


async def test_a_429_says_when_to_come_back(hub: HubUnderTest) -> None:
    b = Backend(hub)
    await b.ok("PUT", f"/api/service/users/{b.id(1)}", name=f"busy{b.base}")
    headers = {"authorization": f"Bearer {b.token(1)}"}
    async with httpx.AsyncClient(base_url=hub.http, timeout=30, headers=headers) as http:
        answers = [await http.get("/api/me") for _ in range(4)]
    assert [r.status_code for r in answers] == [200, 200, 200, 429]
    limited = answers[-1]
    # One token at 0.01 a second: 100 s away, less what the four requests took (however slow the machine).
    assert limited.headers["retry-after"] == limited.headers["ratelimit-reset"], limited.headers
    assert 50 <= int(limited.headers["retry-after"]) <= 100, limited.headers
    assert (limited.headers["ratelimit-limit"], limited.headers["ratelimit-remaining"]) == ("3", "0")
    assert "retry-after" not in answers[0].headers


async def test_a_wrong_service_key_past_its_allowance_says_when_to_come_back(hub: HubUnderTest) -> None:
    b = Backend(hub, key="not-the-key-of-the-chat-backend-0123456789")
    codes = [await b.call("GET", f"/api/service/accounts/{b.id(1)}") for _ in range(11)]
    assert [c[0] for c in codes] == [401] * 10 + [429]
    async with httpx.AsyncClient(base_url=hub.http, timeout=30) as http:
        r = await http.get("/api/service/events", headers={"authorization": f"Bearer {b.key}"})
    assert r.status_code == 429 and 1 <= int(r.headers["retry-after"]) <= 6, r.headers  # 10 a minute


async def test_a_405_names_every_method_of_the_path(hub: HubUnderTest) -> None:
    async with httpx.AsyncClient(base_url=hub.http, timeout=30) as http:
        for method, path, allow in (
            ("DELETE", "/api/me", "GET, HEAD"),
            ("PUT", "/api/groups/1/members", "GET, HEAD, POST"),  # two routes: both methods said
            ("GET", "/api/service/packets", "POST"),
            ("POST", "/api/service/events", "GET, HEAD"),
            ("POST", "/client/redpacket.js", "GET, HEAD"),  # a static file's
        ):
            r = await http.request(method, path)
            assert (r.status_code, r.json()["error"]["code"]) == (405, "method_not_allowed"), path
            assert r.headers["allow"] == allow, (path, r.headers)


async def test_no_answer_of_the_api_is_kept_by_a_cache(hub: HubUnderTest) -> None:
    b = Backend(hub)
    await b.ok("PUT", f"/api/service/users/{b.id(1)}", name=f"cached{b.base}")
    headers = {"authorization": f"Bearer {b.token(1)}"}
    async with httpx.AsyncClient(base_url=hub.http, timeout=30) as http:
        for method, path, auth in (
            ("POST", "/api/login", {}),  # (refused here, no dev login: an answer all the same)
            ("GET", "/api/me", headers),
            ("GET", f"/api/service/accounts/{b.id(1)}", {"authorization": f"Bearer {KEY}"}),
            ("GET", "/api/nothing-here", {}),
        ):
            r = await http.request(method, path, headers=auth)
            assert r.headers["cache-control"] == "no-store", (path, r.status_code, r.headers)
        assert "cache-control" not in (await http.get("/client/redpacket.js")).headers


async def test_idempotency_key_is_the_request_id_and_both_must_agree(hub: HubUnderTest) -> None:
    b = Backend(hub)
    await b.ok("PUT", f"/api/service/users/{b.id(1)}", name=f"keyed{b.base}")
    key = f"topup-{b.base}"
    auth = {"authorization": f"Bearer {KEY}"}
    body = {"user_id": b.id(1), "amount": 500}
    async with httpx.AsyncClient(base_url=hub.http, timeout=30, headers=auth) as http:

        async def topup(headers: dict[str, str], **fields: object) -> httpx.Response:
            return await http.post("/api/service/topup", json={**body, **fields}, headers=headers)

        first = await topup({"idempotency-key": key})
        again = await topup({"idempotency-key": key})
        same = await topup({"idempotency-key": key}, request_id=key)
        both = await topup({"idempotency-key": key}, request_id="another")
    assert first.status_code == 200 and first.json()["request_id"] == key and not first.json()["replay"]
    assert [r.json()["replay"] for r in (again, same)] == [True, True]
    assert (both.status_code, both.json()["error"]["code"]) == (400, "bad_request")
    assert (await b.ok("GET", f"/api/service/accounts/{b.id(1)}"))["balance"] == 500  # paid once


async def test_every_answer_names_its_request_and_an_error_leads_to_the_log_line(
    hub: HubUnderTest, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    b = Backend(hub)
    await b.ok("PUT", f"/api/service/users/{b.id(1)}", name=f"traced{b.base}")
    async with httpx.AsyncClient(base_url=hub.http, timeout=30) as http:
        fine, given, odd = (
            await http.get("/healthz"),
            await http.get("/api/me", headers={"x-request-id": "lb-7f3a.01"}),
            await http.get("/api/me", headers={"x-request-id": "no spaces\tor tabs"}),
        )

        async def broken(*args: object) -> int:
            raise RuntimeError("a bug")

        monkeypatch.setattr("server.money.ledger.balance", broken)
        with caplog.at_level(logging.ERROR, logger="server.hub.httpkit"):
            failed = await http.get("/api/me", headers={"authorization": f"Bearer {b.token(1)}"})
    assert len(fine.headers["x-request-id"]) == 16
    assert given.headers["x-request-id"] == given.json()["error"]["request_id"] == "lb-7f3a.01"
    assert odd.headers["x-request-id"] != "no spaces\tor tabs" and len(odd.headers["x-request-id"]) == 16
    rid = failed.headers["x-request-id"]
    assert failed.status_code == 500 and failed.json()["error"]["request_id"] == rid
    assert [r for r in caplog.records if rid in r.getMessage() and r.exc_info], caplog.text


@pytest.mark.parametrize("trusted", ["", "127.0.0.1"], ids=["no-proxy-named", "loopback-named"])
async def test_x_forwarded_for_is_taken_only_from_a_proxy_the_operator_names(
    hub_settings: Settings, trusted: str
) -> None:
    """Before: any loopback peer was trusted (uvicorn's default), so one picked a fresh made-up address per
    request and 30 wrong service keys were all 401, never 429."""
    # (no dev login: a hub with it refuses every forwarded request, not_local)
    settings = hub_settings.replace(
        service_key=KEY, demo_topup=False, dev_login=False, trusted_proxies=trusted
    )
    async with hub_in_process(settings) as h:
        async with httpx.AsyncClient(base_url=h.http, timeout=30) as http:
            statuses = [
                (
                    await http.get(
                        "/api/service/events",
                        headers={"authorization": "Bearer wrong", "x-forwarded-for": f"203.0.113.{n}"},
                    )
                ).status_code
                for n in range(1, 31)
            ]
    # Named, the proxy's header says who each client is (each its own allowance); else the peer is one
    # (10 a minute: however slowly the 30 go, most past the tenth are refused).
    if trusted:
        assert statuses == [401] * 30, statuses
    else:
        assert statuses[:10] == [401] * 10 and statuses.count(429) >= 15, statuses


def test_uvicorns_forwarded_setting_is_refused_for_the_hubs_own() -> None:
    with pytest.raises(ValueError, match="name the proxies in REDPACKET_TRUSTED_PROXIES"):
        Settings.from_env({"FORWARDED_ALLOW_IPS": "*"})
    with pytest.raises(ValueError, match="TRUSTED_PROXIES holds addresses or networks"):
        Settings.from_env({"REDPACKET_TRUSTED_PROXIES": "lb"}).check()


async def test_the_http_api_is_counted_by_route_method_and_status(hub: HubUnderTest) -> None:
    b = Backend(hub)
    registry = hub.hub.metrics.registry

    def answered(route: str, method: str, status: str) -> float:
        labels = {"route": route, "method": method, "status": status}
        return registry.get_sample_value("redpacket_http_requests_total", labels) or 0.0

    route = "/api/service/accounts/{user_id}"
    before = answered(route, "GET", "404"), answered("unmatched", "GET", "404")
    await b.call("GET", f"/api/service/accounts/{b.id(1)}")  # no such user
    await b.call("GET", "/api/service/nothing")
    assert (answered(route, "GET", "404"), answered("unmatched", "GET", "404")) == (
        before[0] + 1,
        before[1] + 1,
    )
    took = registry.get_sample_value("redpacket_http_request_seconds_count", {"route": route})
    assert took is not None and took >= 1
