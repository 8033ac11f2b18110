"""What a hub exposed to strangers refuses: the demo's conveniences anywhere but on this machine, tokens
for users nobody made, one side changing what the other made (a chat backend's groups and users, a
user's groups)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets
from websockets.exceptions import ConnectionClosed

from server.hub import protocol
from server.hub.tokens import make_token
from server.money import groups, ledger
from server.settings import Settings, child_env
from tests.hubtools import HubUnderTest, hub_in_process, redpacket_up

KEY = "service-key-of-the-chat-backend-0123456789"


# -- the demo's conveniences: loopback only, never beside a backend -----------------------------------------


@pytest.mark.parametrize(
    ("changes", "refused"),
    [
        ({"host": "127.0.0.1"}, None),
        ({"host": "::1"}, None),
        ({"host": "0.0.0.0"}, "only on a hub listening on this machine alone"),
        ({"host": "10.0.0.7"}, "only on a hub listening on this machine alone"),
        ({"service_key": KEY}, "never beside a chat backend"),
        ({"jwks_url": "https://auth.example/jwks.json", "secret": ""}, "never beside a chat backend"),
    ],
)
def test_dev_login_and_demo_money_are_for_loopback_without_a_backend(
    changes: dict[str, Any], refused: str | None
) -> None:
    s = Settings(secret="s" * 32, dev_login=True, demo_topup=True).with_(**changes)
    if refused is None:
        s.check()
        return
    with pytest.raises(ValueError, match=refused):
        s.check()
    with pytest.raises(ValueError, match=refused):  # either one alone
        s.with_(dev_login=False).check()


def test_serve_with_dev_login_on_every_interface_is_one_line_and_exit_2(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "server", "serve", "--host", "0.0.0.0", "--port", "0"],
        env=child_env(REDPACKET_DEV_LOGIN="1", REDPACKET_SECRET="s" * 32, REDPACKET_DATA_DIR=str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2, run.stderr
    assert (
        run.stderr.count("\n") == 1 and "REDPACKET_DEV_LOGIN" in run.stderr and "Traceback" not in run.stderr
    )


async def test_up_on_every_interface_starts_without_dev_login_and_says_so(tmp_path: Path) -> None:
    said: list[str] = []
    with redpacket_up(tmp_path / "data", "--host", "0.0.0.0", said=said) as (url, _):
        local = url.replace("0.0.0.0", "127.0.0.1")
        async with httpx.AsyncClient(base_url=local, timeout=10) as http:
            r = await http.post("/api/login", json={"name": "li"})
        assert (r.status_code, r.json()["error"]["code"]) == (403, "disabled")
    assert any("dev login and demo money are off: it listens beyond this machine" in line for line in said), (
        said
    )


async def test_up_on_loopback_says_loudly_that_anyone_can_be_anyone(tmp_path: Path) -> None:
    said: list[str] = []
    with redpacket_up(tmp_path / "data", said=said) as (url, _):
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            assert (await http.post("/api/login", json={"name": "li"})).status_code == 200
    assert any("DEV LOGIN and DEMO MONEY ON" in line for line in said[:3]), said[:5]


# -- users: who made them ---------------------------------------------------------------------------------


@pytest.fixture
async def demo(hub_settings: Settings) -> AsyncIterator[HubUnderTest]:
    async with hub_in_process(hub_settings) as h:
        yield h


async def test_dev_login_never_issues_the_token_of_a_user_the_backend_made(demo: HubUnderTest) -> None:
    """A backend user (made by the service API on a deployment that had a backend) is not anyone's to
    take by name; and the backend cannot take over a user the hub made."""
    assert await ledger.put_user(demo.core.db, 9_101, "provisioned") == "created"
    async with httpx.AsyncClient(base_url=demo.http, timeout=10) as http:
        r = await http.post("/api/login", json={"name": "provisioned"})
        assert (r.status_code, r.json()["error"]["code"]) == (403, "managed_by_backend"), r.text
        mine = (await http.post("/api/login", json={"name": "walk-in"})).json()["user_id"]
    with pytest.raises(Exception) as taken:
        await ledger.put_user(demo.core.db, mine, "renamed-by-backend")
    assert getattr(taken.value, "code", None) == "id_taken"


async def test_a_token_for_a_user_never_made_is_refused_everywhere(demo: HubUnderTest) -> None:
    """Before: welcomed on the socket (``"user": 9999``, no groups) while /api/me said 404."""
    token = make_token(demo.settings.secret.encode(), 9_999_001, int(time.time()), 600)
    async with websockets.connect(f"{demo.ws}?token={token}") as ws:
        with pytest.raises(ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), 10)
    assert closed.value.rcvd is not None
    assert (closed.value.rcvd.code, closed.value.rcvd.reason) == (
        protocol.CLOSE_USER_UNKNOWN,
        "user_not_found",
    )
    headers = {"authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(base_url=demo.http, timeout=10, headers=headers) as http:
        for method, path, body in (
            ("GET", "/api/me", None),
            ("GET", "/api/me/packets", None),
            ("POST", "/api/groups", {"name": "ghost"}),
            ("POST", "/api/topup", {"amount": 100, "request_id": "ghost"}),
        ):
            r = await http.request(method, path, json=body)
            assert (r.status_code, r.json()["error"]["code"]) == (404, "user_not_found"), (path, r.text)
    assert await demo.core.db.fetchone("SELECT 1 FROM journal WHERE account_id = %s", (9_999_001,)) is None


# -- groups: who made them --------------------------------------------------------------------------------


@pytest.fixture
async def backed(hub_settings: Settings) -> AsyncIterator[HubUnderTest]:
    """A hub beside a chat backend, with user group management explicitly on (REDPACKET_USER_GROUPS=1)."""
    s = hub_settings.with_(service_key=KEY, dev_login=False, demo_topup=False, user_groups="1")
    async with hub_in_process(s) as h:
        yield h


async def _call(h: HubUnderTest, method: str, path: str, token: str, **body: Any) -> tuple[int, Any]:
    async with httpx.AsyncClient(base_url=h.http, timeout=30) as http:
        r = await http.request(method, path, json=body or None, headers={"authorization": f"Bearer {token}"})
    return r.status_code, r.json()


async def test_a_group_the_backend_made_is_not_its_members_to_change(backed: HubUnderTest) -> None:
    """An admin the backend set added a stranger and made her admin, who removed the backend's admin:
    now every such change by a user is refused, and the membership is the backend's."""
    h = backed
    for u, name in ((9_201, "boss"), (9_202, "member"), (9_203, "stranger")):
        assert (await _call(h, "PUT", f"/api/service/users/{u}", KEY, name=name))[0] == 200
    status, _ = await _call(
        h, "PUT", "/api/service/groups/9301", KEY, name="team", members=[9_202], admins=[9_201], version=1
    )
    assert status == 200
    boss = make_token(h.settings.secret.encode(), 9_201, int(time.time()), 600)
    member = make_token(h.settings.secret.encode(), 9_202, int(time.time()), 600)
    for token, method, path, body in (
        (boss, "POST", "/api/groups/9301/members", {"user_ids": [9_203]}),
        (boss, "POST", "/api/groups/9301/admins/9202", {}),
        (boss, "DELETE", "/api/groups/9301/members/9202", {}),
        (member, "DELETE", "/api/groups/9301/members/9202", {}),  # leaving is the backend's to say too
    ):
        status, data = await _call(h, method, path, token, **body)
        assert (status, data["error"]["code"]) == (403, "managed_by_backend"), (path, data)
    assert {int(m["user_id"]): m["role"] for m in await groups.members_of(h.core.db, 9_301)} == {
        9_201: "admin",
        9_202: "member",
    }


async def test_a_group_a_user_made_is_not_the_backends_to_take(backed: HubUnderTest) -> None:
    """Before: the backend's PUT of a user-made group's id answered ``created: false`` and replaced its
    members. Now it is refused ``id_taken`` and the group is untouched."""
    h = backed
    for u, name in ((9_401, "maker"), (9_402, "friend")):
        assert (await _call(h, "PUT", f"/api/service/users/{u}", KEY, name=name))[0] == 200
    maker = make_token(h.settings.secret.encode(), 9_401, int(time.time()), 600)
    status, data = await _call(h, "POST", "/api/groups", maker, name="mine")
    assert status == 200, data
    gid = data["group_id"]
    for method, path, body in (
        ("PUT", f"/api/service/groups/{gid}", {"name": "x", "members": [9_402], "version": 1}),
        ("POST", f"/api/service/groups/{gid}/members", {"user_id": 9_402}),
        ("DELETE", f"/api/service/groups/{gid}/members/9401", {}),
    ):
        status, data = await _call(h, method, path, KEY, **body)
        assert (status, data["error"]["code"]) == (409, "id_taken"), (path, data)
    assert [int(m["user_id"]) for m in await groups.members_of(h.core.db, gid)] == [9_401]


async def test_beside_a_backend_users_make_no_groups_unless_told(hub_settings: Settings) -> None:
    s = hub_settings.with_(service_key=KEY, dev_login=False, demo_topup=False)
    assert not s.users_manage_groups and s.with_(user_groups="1").users_manage_groups
    async with hub_in_process(s) as h:
        assert (await _call(h, "PUT", "/api/service/users/9501", KEY, name="solo"))[0] == 200
        token = make_token(h.settings.secret.encode(), 9_501, int(time.time()), 600)
        status, data = await _call(h, "POST", "/api/groups", token, name="mine")
        assert (status, data["error"]["code"]) == (403, "disabled")


# -- limits per user and per address ------------------------------------------------------------------------


def test_a_service_key_shorter_than_32_characters_is_refused() -> None:
    with pytest.raises(ValueError, match="SERVICE_KEY is too short"):
        Settings(secret="s" * 32, service_key="x").check()
    Settings(secret="s" * 32, service_key="x" * 32).check()


async def test_wrong_service_keys_are_counted_and_an_address_past_its_allowance_waits(
    hub_settings: Settings,
) -> None:
    """2,000 wrong keys took 0.6 s, all 401. Now the fifth wrong key in a minute from one address is the
    last one compared: after it, 429 — the right key included, until the allowance refills."""
    s = hub_settings.with_(
        service_key=KEY, dev_login=False, demo_topup=False, service_key_failures_per_minute=5
    )
    async with hub_in_process(s) as h:
        codes = [(await _call(h, "GET", "/api/service/accounts/1", "wrong-key"))[0] for _ in range(8)]
        assert codes == [401] * 5 + [429] * 3
        status, data = await _call(h, "GET", "/api/service/accounts/1", KEY)
        assert (status, data["error"]["code"]) == (429, "rate_limited")
        assert h.hub.metrics.service_key_failures._value.get() == 5


async def test_http_requests_are_limited_per_address_and_per_user(hub_settings: Settings) -> None:
    s = hub_settings.with_(
        http_per_address_per_second=0.001, http_per_address_burst=6,
        http_per_user_per_second=0.001, http_per_user_burst=3,
    )  # fmt: skip
    async with hub_in_process(s) as h:
        _, token = await h.login("busy")  # (a login is one request from the address)
        codes = [(await _call(h, "GET", "/api/me", token))[0] for _ in range(4)]
        assert codes == [200, 200, 200, 429]  # the user's three
        async with httpx.AsyncClient(base_url=h.http, timeout=10) as http:
            r = await http.post("/api/login", json={"name": "other"})
            assert r.status_code == 200  # the address's sixth
            r = await http.post("/api/login", json={"name": "third"})
        assert (r.status_code, r.json()["error"]["code"]) == (429, "rate_limited")
        assert h.hub.metrics.limited.labels("user")._value.get() == 1
        assert h.hub.metrics.limited.labels("address")._value.get() == 1


async def test_a_user_has_a_bounded_number_of_sockets_and_one_message_allowance(
    hub_settings: Settings,
) -> None:
    """One user opened 300 sockets, all welcomed, and 10 sockets x 35 requests were all served."""
    s = hub_settings.with_(max_sockets_per_user=3, user_msgs_per_second=0.001, user_msgs_burst=10)
    async with hub_in_process(s) as h:
        _, token = await h.login("many")
        open_ = [await h.client(token, sync=False) for _ in range(3)]
        async with websockets.connect(f"{h.ws}?token={token}") as fourth:
            with pytest.raises(ConnectionClosed) as closed:
                await asyncio.wait_for(fourth.recv(), 10)
        assert closed.value.rcvd is not None
        assert (closed.value.rcvd.code, closed.value.rcvd.reason) == (
            protocol.CLOSE_TOO_MANY_SOCKETS,
            "too_many_sockets",
        )
        answered, limited = 0, 0
        for c in open_:
            for _ in range(5):
                try:
                    await c.request("ping")
                    answered += 1
                except Exception as e:
                    assert getattr(e, "code", None) == "rate_limited", e
                    limited += 1
        assert (answered, limited) == (10, 5)
        for c in open_:
            await c.close()


async def test_a_user_makes_a_bounded_number_of_groups_a_minute(hub_settings: Settings) -> None:
    """1,500 groups were made in 10 s by one user; now the fourth in a minute is refused."""
    async with hub_in_process(hub_settings.with_(groups_per_user_per_minute=3)) as h:
        _, token = await h.login("founder")
        codes = [(await _call(h, "POST", "/api/groups", token, name=f"g{i}"))[0] for i in range(4)]
        assert codes == [200, 200, 200, 429]


async def test_adding_members_by_name_is_bounded_and_one_query_per_batch(hub_settings: Settings) -> None:
    async with hub_in_process(hub_settings.with_(max_users_per_request=300)) as h:
        _, token = await h.login("host")
        names = [f"guest{i}" for i in range(300)]
        await ledger.create_users(h.core.db, names)
        gid = (await _call(h, "POST", "/api/groups", token, name="party"))[1]["group_id"]
        status, data = await _call(h, "POST", f"/api/groups/{gid}/members", token, names=[*names, "one-more"])
        assert (status, data["error"]["code"]) == (400, "bad_request")
        started = time.monotonic()
        status, data = await _call(h, "POST", f"/api/groups/{gid}/members", token, names=names)
        assert status == 200 and data["added"] == 300, data
        print(f"300 members added by name in {time.monotonic() - started:.2f} s")
        status, data = await _call(h, "POST", f"/api/groups/{gid}/members", token, names=["nobody", "guest1"])
        assert (status, data["error"]["code"], data["error"]["names"]) == (404, "user_not_found", ["nobody"])
