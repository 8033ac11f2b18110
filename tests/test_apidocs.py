"""docs/openapi.json (the HTTP API) and docs/asyncapi.yaml (the websocket protocol) kept true on live
hubs: every described route answers, and every example is sent (HTTP examples over HTTP, websocket
examples over real sockets in JSON and in msgpack) and answered as the documented schemas say. (The
documents read alone — valid, whole, their examples, error and close codes: ``tests/unit/test_apidocs.py``.)

Examples are sent as written, except the ids a live hub hands out itself (a group a user makes, a packet):
the websocket examples' ``group: 1`` and ``packet: 9`` and the user routes' path ids are replaced by the
live ones. A request example named like a response (or reply) example must be answered with that one."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.typing import Subprotocol

from server import errors
from server.hub import protocol
from server.ids import ID_FIELDS, ID_LIST_FIELDS, ids_as_text
from server.settings import Settings
from tests.apidoctools import ASYNCAPI, OPENAPI, check, deref, escape, params_of
from tests.chatbackend import KEY
from tests.conftest import name_deployment
from tests.hubtools import HubUnderTest, eventually, free_port, hub_in_process
from tests.webhooktools import SECRET


@pytest.fixture
async def hubs(hub_settings: Settings, tmp_path: Path) -> AsyncIterator[tuple[HubUnderTest, HubUnderTest]]:
    """A demo hub (dev login, demo money: the user routes and the websocket; its own SQLite) and a chat
    backend's hub (the service key: the service routes; MariaDB)."""
    demo_db = f"sqlite:///{tmp_path / 'demo.sqlite3'}"
    await name_deployment(demo_db)  # the one key namespace a process may have: groups differ by id
    backend = hub_settings.replace(
        service_key=KEY,
        dev_login=False,
        demo_topup=False,
        # The webhook routes' examples: this endpoint's id is theirs (no worker here: nothing is sent).
        webhook_urls="https://backend.example/hooks",
        webhook_secret=SECRET,
    )
    async with (
        hub_in_process(hub_settings.replace(database_url=demo_db)) as demo,
        hub_in_process(backend) as b,
    ):
        yield demo, b


# The console key the sign-in example gives (docs/openapi.json).
CONSOLE_KEY = "console-key-of-the-examples-0123456789abcdef"


@pytest.fixture
async def console(hub_settings: Settings) -> AsyncIterator[HubUnderTest]:
    """A hub whose operations listener serves the console, as a ``HubUnderTest`` of that listener (the
    hub's state under ``app``)."""
    port = free_port()
    settings = hub_settings.replace(
        metrics_port=port, console_key=CONSOLE_KEY, dev_login=False, demo_topup=False
    )
    async with hub_in_process(settings) as h:
        yield HubUnderTest(f"http://127.0.0.1:{port}", settings, app=h.app)


async def console_session(hub: HubUnderTest) -> str:
    async with httpx.AsyncClient(base_url=hub.http, timeout=30) as http:
        r = await http.post("/api/console/session", json={"key": CONSOLE_KEY})
    return str(r.json()["token"])


def operation(path: str, method: str) -> dict[str, Any]:
    return OPENAPI["paths"][path][method]  # type: ignore[no-any-return]


def expected_status(op: dict[str, Any], name: str) -> str:
    """The status whose response holds an example named ``name`` (200 when none does)."""
    for status, response in op["responses"].items():
        media = deref(OPENAPI, response).get("content", {}).get("application/json", {})
        if name and name in media.get("examples", {}):
            return str(status)
    return "200"


async def send(
    hub: HubUnderTest,
    path: str,
    method: str,
    token: str | None,
    ids: dict[str, int] | None = None,
    text_ids: bool = False,
) -> dict[str, Any]:
    """Every request example of an operation, sent as written (path ids from ``ids``, else the document's);
    each answer checked against the documented response. The last answer's body. ``text_ids``: asked
    with ``Redpacket-Ids: string``, the body's ids sent as strings, and every id answered must be one."""
    op = operation(path, method)
    params = params_of(op)
    url = path.format(
        **{p["name"]: (ids or {}).get(p["name"], p["example"]) for p in params if p["in"] == "path"}
    )
    query = {p["name"]: p["example"] for p in params if p["in"] == "query"}
    bodies = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("examples", {})
    body: Any = None
    for name, example in (bodies or {"": {"value": None}}).items():
        headers = {"authorization": f"Bearer {token}"} if token else {}
        value = example["value"]
        if text_ids:
            headers["redpacket-ids"] = "string"
            value = ids_as_text(value)
        async with httpx.AsyncClient(base_url=hub.http, timeout=30) as http:
            r = await http.request(method, url, params=query, json=value, headers=headers)
        status = str(r.status_code)
        assert status == expected_status(op, name), (method, url, name, r.text)
        response = op["responses"][status]
        pointer = (
            response["$ref"][1:]
            if "$ref" in response
            else f"/paths/{escape(path)}/{method}/responses/{status}"
        )
        body = r.json()
        check(OPENAPI, f"{pointer}/content/application~1json/schema", body)
        assert text_ids == ids_are_text(body) or not any_ids(body), body
    return body  # type: ignore[no-any-return]


def _ids(value: Any) -> Iterator[object]:
    """Every id in a message (``server.ids``' fields)."""
    if isinstance(value, dict):
        for k, v in value.items():
            if k in ID_FIELDS and not isinstance(v, dict | list) and v is not None:
                yield v
            elif k in ID_FIELDS or (k in ID_LIST_FIELDS and isinstance(v, list)):
                yield from (i for i in v if not isinstance(i, dict)) if isinstance(v, list) else ()
                yield from _ids(v)
            else:
                yield from _ids(v)
    elif isinstance(value, list):
        for v in value:
            yield from _ids(v)


def any_ids(value: Any) -> bool:
    return next(_ids(value), None) is not None


def ids_are_text(value: Any) -> bool:
    """Every id in the message is a string of digits (and none an integer)."""
    return all(isinstance(i, str) and i.isdigit() for i in _ids(value))


def tagged(tag: str) -> set[tuple[str, str]]:
    return {(p, m) for p, item in OPENAPI["paths"].items() for m, op in item.items() if tag in op["tags"]}


@pytest.mark.parametrize("text_ids", [False, True], ids=["ids-number", "ids-string"])
async def test_the_user_routes_examples_on_a_live_hub(
    hubs: tuple[HubUnderTest, HubUnderTest], text_ids: bool
) -> None:
    demo, _ = hubs
    done: set[tuple[str, str]] = set()

    async def run(path: str, method: str, token: str | None, **ids: int) -> dict[str, Any]:
        done.add((path, method))
        return await send(demo, path, method, token, ids, text_ids)

    wang = (await run("/api/login", "post", None))["token"]
    li_id, li = await demo.login("li")
    zhao_id, _ = await demo.login("zhao")
    await run("/api/me", "get", wang)
    await run("/api/topup", "post", wang)
    group = int((await run("/api/groups", "post", wang))["group_id"])
    await demo.api("POST", f"/api/groups/{group}/members", wang, user_ids=[li_id])
    await run("/api/groups/{group_id}/members", "post", wang, group_id=group)
    await run("/api/groups/{group_id}/members", "get", wang, group_id=group)
    await run("/api/groups/{group_id}/admins/{user_id}", "post", wang, group_id=group, user_id=li_id)
    async with await demo.client(wang, "json") as sender, await demo.client(li, "json") as grabber:
        packet = (await sender.request("send", group=group, total=500, count=1))["packet_id"]
        await grabber.request("grab", group=group, packet=packet)
    await run("/api/packets/{packet_id}", "get", li, packet_id=packet)
    await run("/api/me/packets/sent", "get", wang)
    await run("/api/me/packets/received", "get", li)
    await run("/api/groups/{group_id}/members/{user_id}", "delete", wang, group_id=group, user_id=zhao_id)
    assert done == tagged("user")


@pytest.mark.parametrize("text_ids", [False, True], ids=["ids-number", "ids-string"])
async def test_the_service_routes_examples_on_a_live_hub(
    hubs: tuple[HubUnderTest, HubUnderTest], text_ids: bool
) -> None:
    _, backend = hubs
    async with httpx.AsyncClient(base_url=backend.http, headers={"authorization": f"Bearer {KEY}"}) as http:
        for user, name in ((1002, "li"), (1003, "zhao")):  # the group example's members
            assert (await http.put(f"/api/service/users/{user}", json={"name": name})).status_code == 200
    done = set()
    for path, method in [
        (p, m) for p, item in OPENAPI["paths"].items() for m in item
    ]:  # in the document's order
        if (path, method) in tagged("service"):
            # (An event's id is the live hub's: the newest one the examples before made.)
            live = {"event_id": await newest_event(backend)} if "{event_id}" in path else None
            await send(backend, path, method, KEY, live, text_ids=text_ids)
            done.add((path, method))
    assert done == tagged("service")
    page = await send(backend, "/api/service/events", "get", KEY, text_ids=text_ids)
    assert {"account.topup", "account.withdrawn", "hold.created"} <= {e["type"] for e in page["events"]}


@pytest.mark.parametrize("text_ids", [False, True], ids=["ids-number", "ids-string"])
async def test_the_console_routes_examples_on_a_live_hub(console: HubUnderTest, text_ids: bool) -> None:
    """Each answered as documented, on packets and users of a live story (a grab paid, one waiting, one
    refused, a refund: ``tests.test_console``)."""
    from tests.test_console import _story

    story = await _story(console.core)
    token = (await send(console, "/api/console/session", "post", None, text_ids=text_ids))["token"]
    done = set()
    for packet in (story["fin"].packet_id, story["old"].packet_id):
        await send(console, "/api/console/packets/{packet_id}", "get", token, {"packet_id": packet}, text_ids)
    for user in (story["w"].admin, story["w"].members[2]):
        await send(console, "/api/console/users/{user_id}", "get", token, {"user_id": user}, text_ids)
        await send(console, "/api/console/users/{user_id}/lift", "post", token, {"user_id": user}, text_ids)
    await send(console, "/api/console/books", "get", token, text_ids=text_ids)
    await send(console, "/api/console/live", "get", token, text_ids=text_ids)
    done = {(p, m) for p, m in tagged("console") if p.startswith("/api/")}
    assert done == {
        ("/api/console/session", "post"),
        ("/api/console/packets/{packet_id}", "get"),
        ("/api/console/users/{user_id}", "get"),
        ("/api/console/users/{user_id}/lift", "post"),
        ("/api/console/books", "get"),
        ("/api/console/live", "get"),
    }


async def newest_event(hub: HubUnderTest) -> int:
    async with httpx.AsyncClient(base_url=hub.http, headers={"authorization": f"Bearer {KEY}"}) as http:
        r = await http.get("/api/service/events", params={"limit": 500})
    return int(r.json()["events"][-1]["id"])


async def test_every_described_route_answers(
    hubs: tuple[HubUnderTest, HubUnderTest], console: HubUnderTest
) -> None:
    """Not 405, and not the 404 of a route that is not there (``not_found``): a refusal of the example's
    ids or body is an answer. The console's, on the operations listener."""
    demo, backend = hubs
    _, token = await demo.login("wang")
    session = await console_session(console)
    missing = []
    for path, item in OPENAPI["paths"].items():
        for method, op in item.items():
            hub, auth = (backend, KEY) if "service" in op["tags"] else (demo, token)
            if "console" in op["tags"]:
                hub, auth = console, session
            params = params_of(op)
            url = path.format(**{p["name"]: p["example"] for p in params if p["in"] == "path"})
            bodies = (
                op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("examples", {})
            )
            body = next(iter(bodies.values()))["value"] if bodies else None
            async with httpx.AsyncClient(base_url=hub.http, timeout=30) as http:
                r = await http.request(method, url, json=body, headers={"authorization": f"Bearer {auth}"})
            json_error = r.status_code >= 400 and r.headers["content-type"] == "application/json"
            code = r.json()["error"]["code"] if json_error else None
            if r.status_code == 405 or (r.status_code == 404 and code == errors.NOT_FOUND):
                missing.append(f"{method.upper()} {path}: {r.status_code}")
            if path == "/openapi.json":  # the file, saying where this hub is (a generated client calls it)
                assert r.json() == {**OPENAPI, "servers": [{"url": hub.http}]}
    assert not missing, missing
    assert await send(demo, "/healthz", "get", None) == {"ok": True}


# -- the websocket ---------------------------------------------------------------------------------------


class Socket:
    """A raw websocket in one encoding: every frame it got, decoded, in order."""

    def __init__(self, ws: ClientConnection, sub: str) -> None:
        self.ws, self.sub = ws, sub
        self.fmt = protocol.DIALECTS[sub].format
        self.frames: list[dict[str, Any]] = []
        self.reader = asyncio.create_task(self._read())

    @classmethod
    async def open(cls, hub: HubUnderTest, token: str, sub: str) -> Socket:
        offered = [Subprotocol(sub), Subprotocol(f"bearer.{token}")]
        ws = await connect(hub.ws, subprotocols=offered, compression=None)
        assert ws.subprotocol == sub
        return cls(ws, sub)

    async def _read(self) -> None:
        async for frame in self.ws:
            assert isinstance(frame, bytes) == (self.fmt == "msgpack")
            self.frames.append(msgpack.unpackb(frame) if isinstance(frame, bytes) else json.loads(frame))

    async def ask(self, message: dict[str, Any]) -> dict[str, Any]:
        await self.ws.send(msgpack.packb(message) if self.fmt == "msgpack" else json.dumps(message))
        await eventually(lambda: any(f["type"] == "reply" and f["id"] == message["id"] for f in self.frames))
        return next(f for f in self.frames if f["type"] == "reply" and f["id"] == message["id"])

    async def close(self) -> None:
        await self.ws.close()
        await self.reader


def live(value: Any, group: int, packet: int, text_ids: bool = False) -> Any:
    """An example with the ids a live hub gave (``group: 1``, ``packet: 9``, a sync's ``"1"``); with
    ``text_ids``, every id as a string (as a version 2 client sends them)."""
    out = dict(value)
    if out.get("group") == 1:
        out["group"] = group
    if out.get("packet") == 9:
        out["packet"] = packet
    if text_ids:
        out = ids_as_text(out)
    if isinstance(out.get("groups"), dict):
        out["groups"] = {str(group) if k == "1" else k: v for k, v in out["groups"].items()}
    return out


def message_named(ref: dict[str, str]) -> tuple[str, dict[str, Any]]:
    name = ref["$ref"].rsplit("/", 1)[1]
    return name, ASYNCAPI["components"]["messages"][name]


def kind_of(frame: dict[str, Any]) -> str:
    """The message a frame the hub sent unasked is, read off the documented messages' constants."""
    for name, message in ASYNCAPI["components"]["messages"].items():
        props = message["payload"].get("properties", {})
        if props.get("type", {}).get("const") == frame["type"] != "reply" and (
            props.get("event", {}).get("const", frame.get("event")) == frame.get("event")
        ):
            return str(name)
    raise AssertionError(f"no message describes {frame}")


async def ask_every_request_example(s: Socket, group: int) -> int:
    """Each request example of the document in turn, its reply checked; the packet the send made."""
    packet = 0
    for op in ASYNCAPI["operations"].values():
        if op["action"] != "receive":
            continue
        for ref in op["messages"]:
            for ex in message_named(ref)[1]["examples"]:
                text_ids = protocol.DIALECTS[s.sub].text_ids
                reply = await s.ask(live(ex["payload"], group, packet, text_ids))
                assert not any_ids(reply) or ids_are_text(reply) == text_ids, reply
                paired = [
                    (name, m, e)
                    for name, m in map(message_named, op["reply"]["messages"])
                    for e in m["examples"]
                    if e["name"] == ex["name"]
                ]
                assert len(paired) == 1, f"{ex['name']}: no one reply example of that name"
                name, _, example = paired[0]
                check(ASYNCAPI, f"/components/messages/{name}/payload", reply)
                if not reply["ok"]:
                    assert reply["error"]["code"] == example["payload"]["error"]["code"]
                if ex["payload"]["type"] == "send" and reply["ok"]:
                    packet = int(reply["data"]["packet_id"])
    return packet


@pytest.mark.parametrize("sub", list(protocol.DIALECTS))
async def test_the_websocket_examples_on_a_live_hub(
    hubs: tuple[HubUnderTest, HubUnderTest], sub: str
) -> None:
    demo, _ = hubs
    fmt = sub.replace(".", "-")
    wang_id, wang = await demo.login(f"wang-{fmt}")
    li_id, li = await demo.login(f"li-{fmt}")
    zhao_id, _ = await demo.login(f"zhao-{fmt}")
    await demo.api("POST", "/api/topup", wang, amount=10_000, request_id="seed")
    group = (await demo.api("POST", "/api/groups", wang, name="family"))["group_id"]
    await demo.api("POST", f"/api/groups/{group}/members", wang, user_ids=[li_id, zhao_id])
    admin, member = await Socket.open(demo, wang, sub), await Socket.open(demo, li, sub)
    try:
        await member.ask({"id": "sync", "type": "sync", "groups": {str(group): None}})
        assert await ask_every_request_example(admin, group)
        # What members see of membership changes, and the notices of the member changed.
        members = f"/api/groups/{group}/members"
        await demo.api("POST", f"/api/groups/{group}/admins/{zhao_id}", wang)
        await demo.api("DELETE", f"{members}/{zhao_id}", wang)
        await demo.api("POST", members, wang, user_ids=[zhao_id])
        await demo.api("DELETE", f"{members}/{li_id}", wang)
        await demo.api("POST", members, wang, user_ids=[li_id])
        events = {message_named(r)[0] for r in ASYNCAPI["operations"]["events"]["messages"]}
        notices = {message_named(r)[0] for r in ASYNCAPI["operations"]["notices"]["messages"]}
        # gap: only after the hub lost a group's events it could not recover (a Redis pub/sub loss).
        await eventually(lambda: {kind_of(f) for f in admin.frames if f["type"] == "event"} == events)
        await eventually(
            lambda: (
                {kind_of(f) for f in member.frames if f["type"] in ("removed", "added")}
                == notices - {"gapNotice"}
            )
        )
        text_ids = protocol.DIALECTS[sub].text_ids
        for frame in admin.frames + member.frames:
            if frame["type"] != "reply":
                check(ASYNCAPI, f"/components/messages/{kind_of(frame)}/payload", frame)
            assert not any_ids(frame) or ids_are_text(frame) == text_ids, frame
        welcome = admin.frames[0]
        assert welcome["type"] == "welcome" and welcome["version"] == protocol.DIALECTS[sub].version
        assert welcome["user"] == (str(wang_id) if text_ids else wang_id)
    finally:
        await admin.close()
        await member.close()
