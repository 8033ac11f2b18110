"""What a hub exposed to strangers refuses: the demo's conveniences anywhere but on this machine, tokens
for users nobody made, one side changing what the other made (a chat backend's groups and users, a
user's groups)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
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

from redpacket_client.connection import HubClient, HubError
from server import errors
from server.hub import protocol
from server.hub.tokens import make_token
from server.money import groups, ledger
from server.settings import Settings, child_env
from server.store import keys
from tests.chatbackend import KEY
from tests.conftest import name_deployment
from tests.hubtools import HubUnderTest, eventually, free_port, hub_in_process, redpacket_up


async def _closed_with(url: str) -> tuple[int, str]:
    """The close code and reason a socket to ``url`` is closed with before anything else comes."""
    async with websockets.connect(url) as ws:
        with pytest.raises(ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), 10)
    assert closed.value.rcvd is not None
    return closed.value.rcvd.code, closed.value.rcvd.reason


# -- the demo's conveniences: loopback only, never beside a backend -----------------------------------------


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


async def test_a_demo_hub_answers_this_machine_only(demo: HubUnderTest) -> None:
    """Loopback is not enough: another site's page whose name resolves to 127.0.0.1 (DNS rebinding) or a
    proxy on this machine would carry dev login to the world. A hub with dev login or demo money on
    refuses a Host that is not loopback and anything a proxy forwarded."""
    port = demo.http.rsplit(":", 1)[1]
    async with httpx.AsyncClient(base_url=demo.http, timeout=10) as http:
        assert (await http.post("/api/login", json={"name": "li"})).status_code == 200
        for headers in (
            {"host": f"rebound.example:{port}"},
            {"x-forwarded-for": "203.0.113.9"},
            {"forwarded": "for=203.0.113.9"},
        ):
            r = await http.post("/api/login", json={"name": "li"}, headers=headers)
            assert (r.status_code, r.json()["error"]["code"]) == (403, "not_local"), headers
        assert (await http.get("/", headers={"host": f"localhost:{port}"})).status_code == 200
    _, token = await demo.login("li")
    with pytest.raises(websockets.InvalidStatus) as refused:
        await websockets.connect(
            f"{demo.ws}?token={token}", additional_headers={"Host": f"rebound.example:{port}"}
        )
    _refused_as(refused.value, 403, errors.NOT_LOCAL)


def _refused_as(refused: websockets.InvalidStatus, status: int, code: str) -> None:
    """A websocket refused before it opened is answered as any HTTP error: the API's JSON error with its
    code, naming its request (``X-Request-Id``, and the same id in the error)."""
    r = refused.response
    error = json.loads(r.body)["error"]
    assert (r.status_code, error["code"]) == (status, code), r.body
    assert error["request_id"] and r.headers["x-request-id"] == error["request_id"]


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


async def test_users_from_before_origins_were_kept_are_the_backends_to_put(demo: HubUnderTest) -> None:
    """Migration 5 gave every existing user origin 'hub', so a deployment with a chat backend, upgraded,
    could no longer put its own users (409 id_taken). Users from before are nobody's: the backend's put
    takes one over, and from then on dev login does not issue its token."""
    old = await ledger.create_user(demo.core.db, "from-before")
    async with demo.core.db.transaction() as tx:
        await tx.execute("UPDATE users SET origin = '' WHERE id = %s", (old,))  # as migration 5 leaves them
    assert await ledger.put_user(demo.core.db, old, "from-before") == "unchanged"
    async with httpx.AsyncClient(base_url=demo.http, timeout=10) as http:
        r = await http.post("/api/login", json={"name": "from-before"})
    assert (r.status_code, r.json()["error"]["code"]) == (403, "managed_by_backend")


async def test_a_token_for_a_user_never_made_is_refused_everywhere(demo: HubUnderTest) -> None:
    """Before: welcomed on the socket (``"user": 9999``, no groups) while /api/me said 404."""
    token = make_token(demo.settings.secret.encode(), 9_999_001, int(time.time()), 600)
    assert await _closed_with(f"{demo.ws}?token={token}") == (protocol.CLOSE_USER_UNKNOWN, "user_not_found")
    headers = {"authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(base_url=demo.http, timeout=10, headers=headers) as http:
        for method, path, body in (
            ("GET", "/api/me", None),
            ("GET", "/api/me/packets/sent", None),
            ("GET", "/api/me/packets/received", None),
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
    s = hub_settings.replace(service_key=KEY, dev_login=False, demo_topup=False, user_groups="1")
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
    s = hub_settings.replace(service_key=KEY, dev_login=False, demo_topup=False)
    assert not s.users_manage_groups and s.replace(user_groups="1").users_manage_groups
    async with hub_in_process(s) as h:
        assert (await _call(h, "PUT", "/api/service/users/9501", KEY, name="solo"))[0] == 200
        token = make_token(h.settings.secret.encode(), 9_501, int(time.time()), 600)
        status, data = await _call(h, "POST", "/api/groups", token, name="mine")
        assert (status, data["error"]["code"]) == (403, "disabled")


# -- limits per user and per address ------------------------------------------------------------------------


async def test_wrong_service_keys_are_counted_and_an_address_past_its_allowance_waits(
    hub_settings: Settings,
) -> None:
    """2,000 wrong keys took 0.6 s, all 401. Now every wrong key is counted, and past five in a minute an
    address's wrong keys are answered 429 until the allowance refills; the right key is still taken (a
    stranger behind the backend's own address must not lock it out)."""
    s = hub_settings.replace(
        service_key=KEY, dev_login=False, demo_topup=False, service_key_failures_per_minute=5
    )
    async with hub_in_process(s) as h:
        codes = [(await _call(h, "GET", "/api/service/accounts/1", "wrong-key"))[0] for _ in range(8)]
        assert codes == [401] * 5 + [429] * 3
        status, _ = await _call(h, "GET", "/api/service/accounts/1", KEY)
        assert status != 429 and status != 401
        assert h.hub.metrics.service_key_failures._value.get() == 8
        assert h.hub.metrics.limited.labels("service_key")._value.get() == 3


async def test_http_requests_are_limited_per_address_and_per_user(hub_settings: Settings) -> None:
    s = hub_settings.replace(
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
    s = hub_settings.replace(max_sockets_per_user=3, user_msgs_per_second=0.001, user_msgs_burst=10)
    async with hub_in_process(s) as h:
        _, token = await h.login("many")
        open_ = [await h.client(token, sync=False) for _ in range(3)]
        fourth = await _closed_with(f"{h.ws}?token={token}")
        assert fourth == (protocol.CLOSE_TOO_MANY_SOCKETS, "too_many_sockets")
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


async def test_sockets_opened_at_once_do_not_pass_the_limit_together(hub_settings: Settings) -> None:
    """The count was read, then the database awaited before the socket counted: twelve sockets opened
    at once all passed a limit of three."""
    async with hub_in_process(hub_settings.replace(max_sockets_per_user=3)) as h:
        _, token = await h.login("rush")
        already = await h.client(token, sync=False)  # one open already

        async def attempt() -> tuple[websockets.ClientConnection, str | int]:
            ws = await websockets.connect(f"{h.ws}?token={token}")
            try:
                first = protocol.decode(await asyncio.wait_for(ws.recv(), 30))
                return ws, str(first["type"])
            except ConnectionClosed as e:
                return ws, e.rcvd.code if e.rcvd is not None else 0

        outcomes = await asyncio.gather(*(attempt() for _ in range(12)))
        seen = sorted(str(o) for _, o in outcomes)
        assert seen == sorted(["welcome"] * 2 + [str(protocol.CLOSE_TOO_MANY_SOCKETS)] * 10), seen
        for ws, _ in outcomes:
            await ws.close()
        await already.close()


async def test_a_user_makes_a_bounded_number_of_groups_a_minute(hub_settings: Settings) -> None:
    """1,500 groups were made in 10 s by one user; now the fourth in a minute is refused."""
    async with hub_in_process(hub_settings.replace(groups_per_user_per_minute=3)) as h:
        _, token = await h.login("founder")
        codes = [(await _call(h, "POST", "/api/groups", token, name=f"g{i}"))[0] for i in range(4)]
        assert codes == [200, 200, 200, 429]


async def test_adding_members_by_name_is_bounded_and_one_query_per_batch(
    hub_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """20,000 names took 1.7 s, one query each: now at most REDPACKET_MAX_USERS_PER_REQUEST, found in one
    query per 500."""
    async with hub_in_process(hub_settings.replace(max_users_per_request=300)) as h:
        _, token = await h.login("host")
        names = [f"guest{i}" for i in range(300)]
        await ledger.create_users(h.core.db, names)
        gid = (await _call(h, "POST", "/api/groups", token, name="party"))[1]["group_id"]
        status, data = await _call(h, "POST", f"/api/groups/{gid}/members", token, names=[*names, "one-more"])
        assert (status, data["error"]["code"]) == (400, "bad_request")
        asked: list[str] = []
        for name in ("fetchall", "fetchone"):
            real = getattr(h.core.db, name)

            def counted(sql: str, *args: Any, _real: Any = real) -> Any:
                if "FROM users WHERE name" in sql:
                    asked.append(sql)
                return _real(sql, *args)

            monkeypatch.setattr(h.core.db, name, counted)
        status, data = await _call(h, "POST", f"/api/groups/{gid}/members", token, names=names)
        assert status == 200 and data["added"] == 300, data
        assert len(asked) == 1, f"{len(asked)} queries for 300 names"
        status, data = await _call(h, "POST", f"/api/groups/{gid}/members", token, names=["nobody", "guest1"])
        assert (status, data["error"]["code"], data["error"]["names"]) == (404, "user_not_found", ["nobody"])


# -- two deployments on one Redis ---------------------------------------------------------------------------


async def _deployment(url: str) -> dict[str, Any]:
    """A deployment's first minutes, the same on both: an admin and a member (user ids 1 and 2), money,
    a group (id 1) with both in it; the member's socket listening."""
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        admin = (await http.post("/api/login", json={"name": "admin"})).json()
        member = (await http.post("/api/login", json={"name": "member"})).json()
        auth = {"authorization": f"Bearer {admin['token']}"}
        await http.post("/api/topup", json={"amount": 10_000, "request_id": "seed"}, headers=auth)
        group = (await http.post("/api/groups", json={"name": "family"}, headers=auth)).json()["group_id"]
        await http.post(f"/api/groups/{group}/members", json={"names": ["member"]}, headers=auth)
    ws = url.replace("http://", "ws://") + "/ws"
    listener = await HubClient.connect(ws, member["token"])
    await listener.sync()
    sender = await HubClient.connect(ws, admin["token"])
    await sender.sync()
    return {
        "url": url,
        "admin": admin,
        "member": member,
        "group": group,
        "listener": listener,
        "sender": sender,
    }


async def _first_chat(c: HubClient, timeout: float) -> str | None:
    """The text of the next chat event ``c`` hears, or None if none comes within ``timeout``."""
    try:
        while True:
            ev = await c.next_event(timeout=timeout)
            if ev["event"] == "chat":
                return str(ev["data"]["text"])
    except TimeoutError:
        return None


async def _chat_and_removal(a: dict[str, Any], b: dict[str, Any], timeout: float) -> str | None:
    """a's admin chats; a's listener must hear it first. a removes its member (the same ids as b's) from
    its group. b's admin chats; b's listener must hear that first (not a's chat, and still attached).
    What went wrong, or None."""
    await a["sender"].request("chat", group=a["group"], text="for a only")
    if (heard := await _first_chat(a["listener"], timeout)) != "for a only":
        return f"a's member heard {heard!r} for its own chat"
    async with httpx.AsyncClient(base_url=a["url"], timeout=10) as http:
        auth = {"authorization": f"Bearer {a['admin']['token']}"}
        r = await http.delete(f"/api/groups/{a['group']}/members/{a['member']['user_id']}", headers=auth)
        assert r.status_code == 200
    await b["sender"].request("chat", group=b["group"], text="for b")
    if (heard := await _first_chat(b["listener"], timeout)) != "for b":
        return f"b's member heard {heard!r} for b's chat"
    return None


@pytest.mark.parametrize(
    ("databases", "namespaces"),
    [("one", "own"), ("two", "own"), ("two", "forced equal")],
    ids=["same-redis-db", "two-redis-dbs", "guard-off"],
)
async def test_two_deployments_on_one_redis_never_meet(
    tmp_path: Path, redis_url: str, databases: str, namespaces: str
) -> None:
    """Pub/sub ignores the database number: a second deployment on db 12 received the first's (db 11)
    chat and membership notes, and acted on them. Two `redpacket up`s on one Redis server, each with
    its own database (so the same user, group and packet ids), one Redis database or two: neither hears
    the other's chat or membership changes, and each pays its own grabs. Guard off (both forced to one
    namespace, on two Redis databases): they meet — a's chat reaches b, a's removal detaches b's member,
    or one hub drops its own group's events as ones it has seen."""
    import redis as sync_redis

    base, _, db = redis_url.rpartition("/")
    urls = [redis_url, redis_url if databases == "one" else f"{base}/{int(db) - 1}"]
    for u in set(urls):
        sync_redis.Redis.from_url(u).flushdb()
    env = [{"REDPACKET_REDIS_URL": u} for u in urls]
    if namespaces == "forced equal":  # both databases given one deployment id before their first start
        for d in ("a", "b"):
            (tmp_path / d).mkdir()
            await name_deployment(f"sqlite:///{tmp_path / d / 'redpacket.sqlite3'}", "shared")
    await _two_deployments(tmp_path, env, guard_off=namespaces == "forced equal")


async def test_two_deployments_on_one_cluster_never_meet(
    tmp_path: Path, redis_url: str, cluster: object
) -> None:
    """The same on one Redis Cluster, their arq queues on one Redis."""
    from tests.redisproc import LocalCluster

    assert isinstance(cluster, LocalCluster)
    cluster.flush()
    env = {"REDPACKET_REDIS_URL": cluster.url, "REDPACKET_QUEUE_REDIS_URL": redis_url}
    await _two_deployments(tmp_path, [env, env], guard_off=False)


async def _two_deployments(tmp_path: Path, env: list[dict[str, str]], guard_off: bool) -> None:
    with (
        redpacket_up(tmp_path / "a", env=env[0]) as (url_a, _),
        redpacket_up(tmp_path / "b", env=env[1]) as (url_b, _),
    ):
        a, b = await _deployment(url_a), await _deployment(url_b)
        assert (a["group"], a["member"]["user_id"]) == (b["group"], b["member"]["user_id"])  # the same ids
        if guard_off:
            # (A chat that never comes is waited for 10 s: here that is the leak, not a slow machine.)
            assert await _chat_and_removal(a, b, timeout=10) is not None
            return
        assert await _chat_and_removal(a, b, timeout=60) is None
        # Money: a packet on each, grabbed by each member; each ledger pays its own.
        for d in (a, b):
            sent = await d["sender"].request("send", group=d["group"], kind="lucky", total=500, count=1)
            d["packet"] = sent["packet_id"]
        assert a["packet"] == b["packet"]
        with pytest.raises(Exception) as gone:  # a's member is not in a's group any more
            await a["listener"].request("grab", group=a["group"], packet=a["packet"])
        assert getattr(gone.value, "code", None) == "not_member"
        got = await b["listener"].request("grab", group=b["group"], packet=b["packet"])
        assert got["amount"] == 500
        async with httpx.AsyncClient(base_url=url_b, timeout=10) as http:
            me = {"authorization": f"Bearer {b['member']['token']}"}

            async def paid() -> bool:
                return bool((await http.get("/api/me", headers=me)).json()["balance"] == 500)

            await eventually(paid, timeout=60)  # b's worker paid b's grab
        async with httpx.AsyncClient(base_url=url_a, timeout=10) as http:
            me = {"authorization": f"Bearer {a['member']['token']}"}
            assert (await http.get("/api/me", headers=me)).json()["balance"] == 0
        for d in (a, b):
            await d["listener"].close()
            await d["sender"].close()


# -- a removal this hub did not hear ------------------------------------------------------------------------


async def _removed_unheard(demo: HubUnderTest, monkeypatch: pytest.MonkeyPatch) -> tuple[int, HubClient]:
    """A member in a group, synced on a socket, then removed with the note sent where this hub does not
    listen (the removal commits and drops the member cache): the group, and the member's socket."""
    admin_id, _ = await demo.login("boss")
    member_id, member_token = await demo.login("leaving")
    group = await groups.create_group(demo.core.db, admin_id, "family")
    await groups.add_members(demo.core.db, demo.core.membership, group, [member_id])
    c = await HubClient.connect(demo.ws, member_token)
    assert group in c.groups
    await c.sync()
    with monkeypatch.context() as m:
        m.setattr(keys, "membership_channel", lambda: keys._root() + "{ctl}:nowhere")
        assert await groups.remove_member(
            demo.core.db, demo.core.membership, group_id=group, user_id=member_id
        )
    return group, c


@pytest.mark.parametrize("kind", ["chat", "presence", "open", "sync"])
async def test_a_removed_member_is_refused_when_the_hub_missed_the_note(
    demo: HubUnderTest, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """Before: a hub that missed the ``removed`` note (its subscriber reconnecting, a failover) let the
    removed member chat, sync and see presence (only grabs were checked again, in Redis). Each request
    that reads or writes a group checks the versioned member cache, refuses, and takes the socket out
    of the group as the note would have."""
    group, c = await _removed_unheard(demo, monkeypatch)
    try:
        if kind == "sync":
            synced = await c.request("sync", groups={str(group): None})
            assert synced["groups"][str(group)] == {"error": "not_member"}
        else:
            with pytest.raises(HubError) as refused:
                await c.request(
                    kind,
                    group=group,
                    **({"text": "still here?"} if kind == "chat" else {}),
                    **({"packet": 1} if kind == "open" else {}),
                )
            assert refused.value.code == "not_member"
        while (notice := await c.next_notice()).get("type") != "removed":
            pass
        assert notice == {"type": "removed", "group": group}
    finally:
        await c.close()


async def test_a_hub_that_was_not_listening_checks_its_members_again(
    demo: HubUnderTest, monkeypatch: pytest.MonkeyPatch, redis_url: str
) -> None:
    """The removal's note lost while the hub's subscriber was away: when it is back, the hub checks
    every member it serves against the member cache, and the removed member's socket leaves the group
    without sending anything."""
    import redis.asyncio as aredis

    group, c = await _removed_unheard(demo, monkeypatch)
    try:
        r = aredis.Redis.from_url(redis_url)
        try:
            assert await r.client_kill_filter(_type="pubsub") >= 1  # the hub's subscriber reconnects
        finally:
            await r.aclose()
        while (notice := await c.next_notice()).get("type") != "removed":
            pass
        assert notice == {"type": "removed", "group": group}
    finally:
        await c.close()


# -- the browser: which pages may connect, and the token out of the URL -------------------------------------


async def test_an_origin_allow_list_keeps_other_sites_pages_out(hub_settings: Settings) -> None:
    """Before: any page on any site could open a socket to the hub. With REDPACKET_ALLOWED_ORIGINS, an
    upgrade from another site's page is answered 403 before it is a websocket; a listed origin, the
    hub's own pages ("self") and programs that send no Origin are welcomed."""
    settings = hub_settings.replace(allowed_origins="https://chat.example.com, self")
    settings.check()
    async with hub_in_process(settings) as h:
        _, token = await h.login("li")
        url = f"{h.ws}?token={token}"
        own = h.http.lower()
        for origin in ("https://chat.example.com", own, None):
            headers = {"Origin": origin} if origin else {}
            async with websockets.connect(url, additional_headers=headers) as ws:
                welcome = protocol.decode(await asyncio.wait_for(ws.recv(), 10))
                assert welcome["type"] == "welcome", origin
        for origin in ("https://evil.example", "http://chat.example.com", "https://chat.example.com.evil.io"):
            with pytest.raises(websockets.InvalidStatus) as refused:
                await websockets.connect(url, additional_headers={"Origin": origin})
            _refused_as(refused.value, 403, errors.ORIGIN_NOT_ALLOWED)
        async with httpx.AsyncClient(timeout=10) as http:
            metrics = (await http.get(f"{h.http}/metrics")).text
        assert 'redpacket_hub_limited_total{limit="origin"} 3.0' in metrics
    with pytest.raises(ValueError, match="ALLOWED_ORIGINS"):
        hub_settings.replace(allowed_origins="https://chat.example.com/app").check()


async def test_up_lets_only_its_own_page_connect(tmp_path: Path) -> None:
    with redpacket_up(tmp_path / "data") as (url, _):
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            token = (await http.post("/api/login", json={"name": "li"})).json()["token"]
        ws_url = url.replace("http://", "ws://") + f"/ws?token={token}"
        async with websockets.connect(ws_url, additional_headers={"Origin": url}) as ws:
            assert protocol.decode(await asyncio.wait_for(ws.recv(), 10))["type"] == "welcome"
        with pytest.raises(websockets.InvalidStatus) as refused:
            await websockets.connect(ws_url, additional_headers={"Origin": "https://evil.example"})
        _refused_as(refused.value, 403, errors.ORIGIN_NOT_ALLOWED)


async def test_the_token_can_travel_as_a_subprotocol_never_echoed(demo: HubUnderTest) -> None:
    """A browser cannot set a header on a websocket, and a URL ends up in logs: the token is taken from
    a ``bearer.<token>`` subprotocol offered beside the format, which is the one accepted."""
    user, token = await demo.login("li")
    offered = [protocol.SUBPROTOCOL_JSON, protocol.TOKEN_SUBPROTOCOL + token]
    async with websockets.connect(demo.ws, subprotocols=offered) as ws:  # type: ignore[arg-type]
        assert ws.subprotocol == protocol.SUBPROTOCOL_JSON
        welcome = json.loads(await asyncio.wait_for(ws.recv(), 10))
        assert (welcome["type"], welcome["user"]) == ("welcome", user)
    bad = [protocol.SUBPROTOCOL_JSON, protocol.TOKEN_SUBPROTOCOL + token[:-4] + "AAAA"]
    async with websockets.connect(demo.ws, subprotocols=bad) as ws:  # type: ignore[arg-type]
        with pytest.raises(ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), 10)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == protocol.CLOSE_UNAUTHORIZED


# -- what the page and the operators' routes give away -------------------------------------------------------


async def test_the_demo_page_and_every_answer_carry_security_headers(demo: HubUnderTest) -> None:
    """Before: none. The page runs no inline script, so its policy allows none; it is never framed."""
    async with httpx.AsyncClient(base_url=demo.http, timeout=10) as http:
        for path in ("/", "/app.js", "/api/me", "/healthz", "/no-such-page"):
            r = await http.get(path)
            csp = r.headers.get("content-security-policy", "")
            assert "script-src 'self'" in csp and "unsafe-inline" not in csp, (path, csp)
            assert "frame-ancestors 'none'" in csp, path
            assert r.headers.get("x-frame-options") == "DENY", path
            assert r.headers.get("x-content-type-options") == "nosniff", path
            assert r.headers.get("referrer-policy") == "no-referrer", path
        page = (await http.get("/")).text
    assert re.search(r"<script(?![^>]*\bsrc=)", page) is None  # no inline script for the policy to break
    assert re.search(r"<[^>]*\son\w+=", page) is None  # no inline handlers either


async def test_healthz_says_what_is_down_never_the_errors_text(
    demo: HubUnderTest, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: the raw MySQL / Redis error (hosts, user names) went to whoever asked."""
    secret = "Access denied for user 'redpacket'@'10.1.2.3' (using password: YES)"

    async def refused(*_: object) -> None:
        raise RuntimeError(secret)

    caplog.set_level(logging.WARNING, logger="server.hub.app")
    monkeypatch.setattr(demo.core.db, "fetchone", refused)
    async with httpx.AsyncClient(base_url=demo.http, timeout=10) as http:
        r = await http.get("/healthz")
    assert r.status_code == 503
    assert r.json()["error"] == {
        "code": "database_unavailable",
        "message": "the database is unavailable",
        "request_id": r.headers["x-request-id"],
    }
    assert "10.1.2.3" not in r.text
    assert any(secret in rec.getMessage() for rec in caplog.records)  # the operator still reads it


async def test_metrics_can_be_kept_off_the_public_port(hub_settings: Settings) -> None:
    """Before: /metrics answered anyone on the hub's port. With REDPACKET_METRICS_PORT they are served on
    that port (on REDPACKET_METRICS_HOST, loopback by default) and the hub's port answers 404."""
    port = free_port()
    async with hub_in_process(hub_settings.replace(metrics_port=port)) as h:
        async with httpx.AsyncClient(timeout=10) as http:
            public = await http.get(f"{h.http}/metrics")
            assert (public.status_code, public.json()["error"]["code"]) == (404, "not_found")
            apart = await http.get(f"http://127.0.0.1:{port}/metrics")
            assert apart.status_code == 200 and "redpacket_grab_seconds_bucket" in apart.text
            assert apart.headers["content-type"].startswith("text/plain")
            assert (await http.get(f"http://127.0.0.1:{port}/api/me")).status_code == 404


def test_a_busy_metrics_port_is_one_line_and_an_exit_code(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as busy:
        run = subprocess.run(
            [sys.executable, "-m", "server", "serve", "--port", "0"],
            env=child_env(
                REDPACKET_SECRET="s" * 32,
                REDPACKET_DATA_DIR=str(tmp_path),
                REDPACKET_REDIS_URL="embedded",  # (refused before it would start)
                REDPACKET_DATABASE_URL=f"sqlite:///{tmp_path / 'ledger.sqlite3'}",
                REDPACKET_METRICS_PORT=str(busy.getsockname()[1]),
            ),
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "cannot serve the hub's metrics on 127.0.0.1:" in lines[0], run.stderr
