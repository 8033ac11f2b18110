"""Hostile input from anyone, most of it before logging in: odd tokens, odd text, ids out of range,
oversized and never-finished handshakes. Each gets a clear answer and moves no money."""

from __future__ import annotations

import asyncio
import json
import logging
from urllib.parse import quote

import httpx
import msgpack
import pytest
import websockets
from websockets.exceptions import ConnectionClosed

from server.hub import protocol
from server.settings import Settings
from tests.books import locked_tables
from tests.hubtools import HubUnderTest, hub_in_process, make_room


async def _refused_with(url: str) -> tuple[int, str]:
    async with websockets.connect(url, subprotocols=[protocol.SUBPROTOCOL_JSON]) as ws:  # type: ignore[list-item]
        with pytest.raises(ConnectionClosed) as e:
            await asyncio.wait_for(ws.recv(), 10)
    assert e.value.rcvd is not None
    return e.value.rcvd.code, e.value.rcvd.reason


async def test_a_non_ascii_token_closes_with_4001(h: HubUnderTest) -> None:
    _, token = await h.login("li")
    head, body, sig = token.split(".")
    bad_tokens = [f"{head}.{body}.{sig[:-1]}é", f"²{head}.{body}.{sig}", "红包.1.2"]
    for bad in bad_tokens:
        assert await _refused_with(f"{h.ws}?token={quote(bad)}") == (4001, "token_invalid")
    # Over HTTP the header's bytes arrive as Latin-1 text: refused the same way, as a JSON error.
    async with httpx.AsyncClient(base_url=h.http, timeout=10) as http:
        for bad in bad_tokens:
            header = b"Bearer " + bad.encode()
            r = await http.get("/api/me", headers={"authorization": header})
            assert r.status_code == 401 and r.json()["error"]["code"] == "token_invalid"


# -- text: lone surrogates and control characters ----------------------------------------------------------


class RawJson:
    """A websocket speaking raw JSON text frames, for frames no well-behaved client would send."""

    def __init__(self, ws: websockets.ClientConnection) -> None:
        self.ws = ws

    async def ask(self, frame: str) -> dict[str, object]:
        await self.ws.send(frame)
        while True:
            msg = json.loads(await asyncio.wait_for(self.ws.recv(), 10))
            if msg["type"] == "reply":
                return msg  # type: ignore[no-any-return]


async def _raw(h: HubUnderTest, token: str) -> RawJson:
    ws = await websockets.connect(f"{h.ws}?token={token}", subprotocols=[protocol.SUBPROTOCOL_JSON])  # type: ignore[list-item]
    return RawJson(ws)


async def test_lone_surrogates_are_bad_requests_and_move_nothing(
    h: HubUnderTest, caplog: pytest.LogCaptureFixture
) -> None:
    room = await make_room(h, 1)
    raw = await _raw(h, room.admin_token)
    g = room.group
    for frame, rid in [
        (f'{{"id": 1, "type": "chat", "group": {g}, "text": "hi \\ud800"}}', 1),
        (f'{{"id": 2, "type": "send", "group": {g}, "total": 100, "count": 1, "greeting": "\\udfff"}}', 2),
        (f'{{"id": 3, "type": "send", "group": {g}, "total": 100, "count": 1, "request_id": "\\ud83d"}}', 3),
        ('{"id": "\\ud800", "type": "ping"}', None),
        ('{"id": 5, "type": "sync", "groups": {"\\ud800": null}}', 5),
    ]:
        reply = await raw.ask(frame)
        assert reply["ok"] is False and reply["id"] == rid, reply
        assert reply["error"]["code"] == "bad_request", reply  # type: ignore[index]
    assert (await raw.ask('{"id": 9, "type": "ping"}'))["ok"] is True  # the socket is still fine
    await raw.ws.close()
    me = await h.api("GET", "/api/me", room.admin_token)
    assert me["balance"] == 1_000_000
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    # The HTTP API says the same, as its JSON error.
    async with httpx.AsyncClient(base_url=h.http, timeout=10) as http:
        r = await http.post(
            "/api/groups",
            content=b'{"name": "x\\ud800"}',
            headers={"authorization": f"Bearer {room.admin_token}"},
        )
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_request"


async def test_control_characters_are_refused_in_names_greetings_and_chat(h: HubUnderTest) -> None:
    room = await make_room(h, 1)
    for name in ["li\x00", "\x1b[31mli", "li\u202egnp.exe", "l\u200bi", "\ufeffli", "a\u2028b"]:
        reply = await h.api("POST", "/api/login", name=name)
        assert reply["error"]["code"] == "name_invalid", name
        reply = await h.api("POST", "/api/groups", room.admin_token, name=name)
        assert reply["error"]["code"] == "name_invalid", name
    family = "\U0001f468\u200d\U0001f469\u200d\U0001f467"  # a ZWJ emoji sequence is a fine name
    assert "user_id" in await h.api("POST", "/api/login", name=family)
    raw = await _raw(h, room.admin_token)
    g = room.group
    for said in ["a\x00b", "\x1b]0;pwned\x07", "abc\u202edcba", "x\u2066y", "\x7f"]:
        reply = await raw.ask(json.dumps({"id": 1, "type": "chat", "group": g, "text": said}))
        assert reply["error"]["code"] == "text_invalid", said  # type: ignore[index]
        frame = {"id": 2, "type": "send", "group": g, "total": 100, "count": 1, "greeting": said}
        reply = await raw.ask(json.dumps(frame))
        assert reply["error"]["code"] == "greeting_invalid", said  # type: ignore[index]
    ok = await raw.ask(json.dumps({"id": 3, "type": "chat", "group": g, "text": "two\nlines\tand a tab"}))
    assert ok["ok"] is True
    await raw.ws.close()
    assert (await h.api("GET", "/api/me", room.admin_token))["balance"] == 1_000_000


# -- ids out of range, and every HTTP error as JSON ---------------------------------------------------------


@pytest.fixture(params=["sqlite", "mysql"])
async def h_any(
    request: pytest.FixtureRequest, hub_settings: Settings, tmp_path_factory: pytest.TempPathFactory
) -> HubUnderTest:
    """A hub on each database: SQLite's integers stop at 2**63 - 1 and it refuses bigger ones loudly."""
    s = hub_settings
    if request.param == "sqlite":
        s = s.replace(database_url=f"sqlite:///{tmp_path_factory.mktemp('db') / 'hub.sqlite3'}")
    async with hub_in_process(s) as hub:
        yield hub  # type: ignore[misc]


BIG = [2**63, 2**63 + 1, 2**64 - 1, 2**64 + 5, 0, -1]


async def test_ids_out_of_range_are_not_found_on_both_databases(
    h_any: HubUnderTest, caplog: pytest.LogCaptureFixture
) -> None:
    h = h_any
    room = await make_room(h, 1)
    raw = await _raw(h, room.members[0][1])
    admin = await _raw(h, room.admin_token)
    g = room.group
    for big in BIG:
        for kind in ("grab", "open"):
            reply = await raw.ask(json.dumps({"id": 1, "type": kind, "group": g, "packet": big}))
            assert reply["error"]["code"] == "packet_not_found", (kind, big, reply)  # type: ignore[index]
        reply = await raw.ask(json.dumps({"id": 2, "type": "grab", "group": big, "packet": 1}))
        assert reply["error"]["code"] == "not_member", reply  # type: ignore[index]
        frame = {"id": 3, "type": "send", "group": g, "kind": "exclusive", "total": 100, "target": big}
        reply = await admin.ask(json.dumps(frame))
        assert reply["error"]["code"] == "target_invalid", reply  # type: ignore[index]
    await raw.ws.close()
    await admin.ws.close()
    t = room.admin_token
    for big in BIG[:4]:
        for method, path, body, code in [
            ("GET", f"/api/packets/{big}", {}, "packet_not_found"),
            ("GET", f"/api/groups/{big}/members", {}, "group_not_found"),
            ("POST", f"/api/groups/{big}/members", {"user_ids": [1]}, "group_not_found"),
            ("POST", f"/api/groups/{g}/members", {"user_ids": [big]}, "user_not_found"),
            ("DELETE", f"/api/groups/{g}/members/{big}", {}, "user_not_found"),
            ("POST", f"/api/groups/{g}/admins/{big}", {}, "user_not_found"),
        ]:
            async with httpx.AsyncClient(base_url=h.http, timeout=10) as http:
                r = await http.request(
                    method, path, json=body or None, headers={"authorization": f"Bearer {t}"}
                )
            assert r.status_code == 404 and r.json()["error"]["code"] == code, (path, r.text)
    assert (await h.api("GET", "/api/me", t))["balance"] == 1_000_000
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


async def test_every_http_error_is_the_documented_json(
    h: HubUnderTest, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _, token = await h.login("li")
    async with httpx.AsyncClient(base_url=h.http, timeout=10) as http:
        auth = {"authorization": f"Bearer {token}"}
        for method, path, status, code in [
            ("GET", "/api/nothing-here", 404, "not_found"),
            ("GET", "/no-such-file.png", 404, "not_found"),
            ("DELETE", "/api/me", 405, "method_not_allowed"),
            ("GET", "/api/packets/%C2%B2", 400, "bad_request"),
            ("GET", "/api/packets/abc", 400, "bad_request"),
        ]:
            r = await http.request(method, path, headers=auth)
            assert r.status_code == status and r.json()["error"]["code"] == code, (path, r.text)

        async def broken(*args: object) -> int:
            raise RuntimeError("a bug")

        monkeypatch.setattr("server.money.ledger.balance", broken)
        r = await http.get("/api/me", headers=auth)
    rid = r.headers["x-request-id"]
    assert r.status_code == 500
    assert r.json() == {"error": {"code": "internal", "message": "internal error", "request_id": rid}}
    assert "a bug" in caplog.text  # the operator still sees the traceback


# -- handshakes: oversized, never finished, stalled ----------------------------------------------------------


@pytest.fixture
async def h_quick(hub_settings: Settings) -> HubUnderTest:
    """A hub that gives a connection one second to send its request whole."""
    async with hub_in_process(hub_settings.replace(handshake_seconds=1.0)) as hub:
        yield hub  # type: ignore[misc]


async def _answer(host: str, port: int, request: bytes, then_wait: bool = False) -> bytes:
    """Send ``request`` on a raw TCP connection; return everything the server sends until it closes.
    Fails if the server neither answers nor closes within 15 s."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(request)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 15)
    finally:
        writer.close()


def _status_and_code(answer: bytes) -> tuple[int, str]:
    """An HTTP answer's status and the code of its JSON error body; the answer names its request as every
    answer does (``X-Request-Id``, and the same id in the error), a refusal before the app included."""
    head, _, body = answer.partition(b"\r\n\r\n")
    error = json.loads(body)["error"]
    ids = [
        line.split(b":", 1)[1].strip().decode()
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"x-request-id:")
    ]
    assert ids == [error.get("request_id")] and ids[0], head
    return int(head.split(b" ")[1]), error["code"]


def _upgrade(path: str, extra: str = "") -> bytes:
    return (
        f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n{extra}\r\n"
    ).encode()


async def test_an_oversized_upgrade_request_is_answered_and_closed(h: HubUnderTest) -> None:
    host, port = h.http.removeprefix("http://").split(":")
    answer = await _answer(host, int(port), _upgrade("/ws?token=" + "a" * 9_000))
    assert _status_and_code(answer) == (414, "request_too_large"), answer[:100]
    answer = await _answer(host, int(port), _upgrade("/ws?token=x", f"X-Long: {'b' * 9_000}\r\n"))
    assert _status_and_code(answer) == (431, "request_too_large"), answer[:100]
    # A whole head over 16 KB in one write (20 headers of 1 KB: each under the 8 KB a header may be, and
    # fewer than 64): it was counted only while incomplete, so one read of it all passed.
    wide = "".join(f"X-{i}: {'c' * 1_000}\r\n" for i in range(20))
    answer = await _answer(host, int(port), _upgrade("/ws?token=x", wide))
    assert _status_and_code(answer) == (431, "request_too_large"), answer[:100]
    many = "".join(f"X-{i}: y\r\n" for i in range(200))
    answer = await _answer(host, int(port), _upgrade("/ws?token=x", many))
    assert _status_and_code(answer) == (431, "request_too_large"), answer[:100]
    # An upgrade websockets refuses (no key; another version) is answered as any API error too.
    keyless = _upgrade("/ws?token=x").replace(b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n", b"")
    assert _status_and_code(await _answer(host, int(port), keyless)) == (400, "bad_request")
    other = _upgrade("/ws?token=x").replace(b"Version: 13", b"Version: 8")
    assert _status_and_code(await _answer(host, int(port), other))[1] == "bad_request"
    # The hub is fine afterwards.
    _, token = await h.login("li")
    c = await h.client(token)
    assert (await c.request("ping"))["ts"] > 0
    await c.close()


async def test_a_connection_that_never_finishes_its_request_is_closed_in_time(h_quick: HubUnderTest) -> None:
    h = h_quick
    host, port = h.http.removeprefix("http://").split(":")
    _, token = await h.login("li")
    early = await h.client(token)  # welcomed before the slow ones come: their deadline is not its
    silent = asyncio.create_task(_answer(host, int(port), b""))
    trickle = asyncio.create_task(
        _answer(host, int(port), b"GET /ws?token=x HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    )
    half_body = asyncio.create_task(
        _answer(
            host, int(port), b"POST /api/login HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{"
        )
    )
    for task in (silent, trickle):
        assert _status_and_code(await task) == (408, "request_timeout")
    assert await half_body == b""  # a body that stops coming: the connection is cut
    # Keep-alive: a finished request does not count against the next one, and a welcomed socket stays.
    async with httpx.AsyncClient(base_url=h.http, timeout=10) as http:
        for _ in range(3):
            assert (await http.get("/healthz")).json() == {"ok": True}
    assert (await early.request("ping"))["ts"] > 0
    await early.close()


async def test_a_stalled_database_during_the_welcome_closes_with_1013(h_quick: HubUnderTest) -> None:
    h = h_quick
    _, token = await h.login("li")
    # Another session holds the member table: the hub's read of the user's groups waits on it.
    with locked_tables(h.settings.database_url, "group_members", "chat_groups"):
        assert await _refused_with(f"{h.ws}?token={token}") == (1013, "timeout")
    c = await h.client(token)
    assert (await c.request("ping"))["ts"] > 0
    await c.close()


async def test_malformed_offsets_refuse_the_sync_and_hold_nothing(h: HubUnderTest) -> None:
    room = await make_room(h, 1)
    raw = await _raw(h, room.members[0][1])
    g = str(room.group)
    for offset in ["abc", 5, "1-2-3", "", "-1", "18446744073709551616-0", "1-", ["1-0"], True]:
        reply = await raw.ask(json.dumps({"id": 1, "type": "sync", "groups": {g: offset}}))
        assert reply["ok"] is False and reply["error"]["code"] == "bad_request", (offset, reply)  # type: ignore[index]
    # "<ms>" alone means "<ms>-0": everything after that millisecond's first event.
    reply = await raw.ask(json.dumps({"id": 2, "type": "sync", "groups": {g: "0"}}))
    assert reply["ok"] is True and reply["data"]["groups"][g]["too_old"] is False  # type: ignore[index]
    await raw.ws.close()


async def test_invalid_utf8_in_a_text_frame_closes_with_1007(h: HubUnderTest) -> None:
    _, token = await h.login("li")
    async with websockets.connect(f"{h.ws}?token={token}", subprotocols=[protocol.SUBPROTOCOL_JSON]) as ws:  # type: ignore[list-item]
        assert json.loads(await ws.recv())["type"] == "welcome"
        await ws.send(b'{"id": 1, "type": "ping", "x": "\xff\xfe"}', text=True)
        with pytest.raises(ConnectionClosed) as e:
            while True:
                await asyncio.wait_for(ws.recv(), 10)
    assert e.value.rcvd is not None and e.value.rcvd.code == 1007


async def test_an_unknown_subprotocol_gets_msgpack(h: HubUnderTest) -> None:
    _, token = await h.login("li")
    async with websockets.connect(f"{h.ws}?token={token}", subprotocols=["chat.v9"]) as ws:  # type: ignore[list-item]
        assert ws.subprotocol is None
        welcome = await asyncio.wait_for(ws.recv(), 10)
        assert isinstance(welcome, bytes) and msgpack.unpackb(welcome)["type"] == "welcome"


async def test_an_id_too_long_is_answered_with_null(h: HubUnderTest) -> None:
    _, token = await h.login("li")
    raw = await _raw(h, token)
    for bad in ["x" * 65, 1.5, 2**64, [1], None]:
        reply = await raw.ask(json.dumps({"id": bad, "type": "ping"}))
        assert reply["id"] is None and reply["error"]["code"] == "bad_request", (bad, reply)  # type: ignore[index]
    assert (await raw.ask(json.dumps({"id": "x" * 64, "type": "ping"})))["id"] == "x" * 64
    await raw.ws.close()


# -- bounds on what one request may carry -----------------------------------------------------------------


async def test_a_body_over_the_limit_is_refused_before_it_is_read(h: HubUnderTest) -> None:
    """A Content-Length over the bound is answered 413 at once: the hub reads none of it (the client is
    told while it has sent only the head)."""
    host, port = h.http.removeprefix("http://").split(":")
    head = b"POST /api/login HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    answer = await _answer(host, int(port), head + b"Content-Length: 157286400\r\n\r\n")
    assert _status_and_code(answer) == (413, "request_too_large"), answer[:200]
    assert b"65536" in answer


async def _send_until_answered(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, chunk: bytes, most: int
) -> int:
    """Write ``chunk`` again and again, as a client streaming a huge request does, until the server's
    answer starts (or ``most`` bytes); returns how many bytes were written."""
    sent = 0
    answered = asyncio.ensure_future(reader.readexactly(1))
    while sent < most and not answered.done():
        writer.write(chunk)
        await asyncio.wait([answered, asyncio.ensure_future(writer.drain())], return_when="FIRST_COMPLETED")
        sent += len(chunk)
    first = await asyncio.wait_for(answered, 15)
    reader._buffer[:0] = first  # type: ignore[attr-defined]  # (put the byte back for the caller's read)
    return sent


async def test_a_chunked_body_is_cut_where_it_passes_the_limit(h: HubUnderTest) -> None:
    """A chunked body has no length to check: it is answered 413 and the connection closed as soon as it
    passes the bound, long before the 10 MB the client means to send."""
    host, port = h.http.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(b"POST /api/login HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"%x\r\n%s\r\n" % (16_384, b" " * 16_384)
        sent = await _send_until_answered(reader, writer, chunk, 10_000_000)
        answer = await asyncio.wait_for(reader.read(), 15)
    finally:
        writer.close()
    assert _status_and_code(answer) == (413, "request_too_large"), answer[:200]
    assert sent < 5_000_000, sent


async def test_the_chat_backends_routes_take_larger_bodies(hub_settings: Settings) -> None:
    """/api/service/* takes a group of 100,000 members in one body (1.2 MB): over the user routes' bound,
    under its own."""
    key = "k" * 32
    async with (
        hub_in_process(hub_settings.replace(service_key=key)) as h,
        httpx.AsyncClient(base_url=h.http, timeout=60, headers={"authorization": f"Bearer {key}"}) as http,
    ):
        for u in (1, 2):
            assert (await http.put(f"/api/service/users/{u}", json={"name": f"u{u}"})).status_code == 200
        members = [1, 2, *range(3, 100_001)]
        body = json.dumps({"name": "big", "members": members, "admins": [1]}).encode()
        assert len(body) > 65_536
        r = await http.put(
            "/api/service/groups/7", content=body, headers={"content-type": "application/json"}
        )
        assert r.status_code != 413, r.text
        r = await http.post("/api/login", json={"name": "x" * 70_000})
        assert (r.status_code, r.json()["error"]["code"]) == (413, "request_too_large")


async def test_headers_over_the_limit_are_refused_by_size_and_by_count(h: HubUnderTest) -> None:
    """A 60 MB header was answered 200: now a request line and headers over 16 KB (counted as the bytes
    arrive, so the hub holds no more than that and a read) or over 64 headers are answered 431."""
    host, port = h.http.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Long: ")
        sent = await _send_until_answered(reader, writer, b"b" * 65_536, 60_000_000)
        answer = await asyncio.wait_for(reader.read(), 15)
    finally:
        writer.close()
    assert _status_and_code(answer) == (431, "request_too_large"), answer[:200]
    assert sent < 10_000_000, sent
    many = "".join(f"X-{i}: y\r\n" for i in range(65)).encode()
    answer = await _answer(host, int(port), b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n" + many + b"\r\n")
    assert _status_and_code(answer) == (431, "request_too_large"), answer[:200]
    async with httpx.AsyncClient(base_url=h.http, timeout=10) as http:  # the hub is fine afterwards
        assert (await http.get("/healthz")).json() == {"ok": True}


def _nested(depth: int) -> str:
    return '{"a":' * depth + "1" + "}" * depth


@pytest.mark.parametrize("depth", [33, 900, 100_000])
async def test_deeply_nested_json_is_a_bad_request_with_no_traceback(
    h: HubUnderTest, depth: int, caplog: pytest.LogCaptureFixture
) -> None:
    """A body or a frame nested past 32 (900 gave a 500 and two tracebacks of 2,000 lines; 100,000 runs
    past the parser's own recursion guard) is answered bad_request, on HTTP and on the socket, which
    stays open; nothing is logged at error level."""
    async with httpx.AsyncClient(base_url=h.http, timeout=30) as http:
        r = await http.post(
            "/api/login", content=_nested(depth).encode(), headers={"content-type": "application/json"}
        )
    if depth * 6 > 65_536:
        assert (r.status_code, r.json()["error"]["code"]) == (413, "request_too_large")
    else:
        assert (r.status_code, r.json()["error"]["code"]) == (400, "bad_request"), r.text
    _, token = await h.login("deep")
    async with websockets.connect(
        f"{h.ws}?token={token}",
        subprotocols=[protocol.SUBPROTOCOL_JSON],
        max_size=None,  # type: ignore[list-item]
    ) as ws:
        assert json.loads(await ws.recv())["type"] == "welcome"
        frame = '{"id":1,"type":"ping","x":' + _nested(min(depth, 10_000)) + "}"
        await ws.send(frame)
        reply = json.loads(await asyncio.wait_for(ws.recv(), 10))
        assert reply["error"]["code"] in ("bad_request", "bad_frame"), reply
        await ws.send(msgpack.packb({"id": 2, "type": "ping", "x": [[[[[[]]]]]] * 2}))
        # {"id": 3, "type": "ping", "x": [[[...1...]]]} written by hand: msgpack's own packer refuses depth.
        head = b"\x83" + b"".join(msgpack.packb(v) for v in ("id", 3, "type", "ping", "x"))
        await ws.send(head + b"\x91" * min(depth, 10_000) + b"\x01")
        answers = [json.loads(await asyncio.wait_for(ws.recv(), 10)) for _ in range(2)]
        assert answers[0]["id"] == 2 and "error" not in answers[0], answers[0]
        assert answers[1]["error"]["code"] in ("bad_request", "bad_frame"), answers[1]
        await ws.send(json.dumps({"id": 4, "type": "ping"}))
        assert json.loads(await asyncio.wait_for(ws.recv(), 10))["id"] == 4  # still open
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.records[:3]
