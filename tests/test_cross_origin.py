"""A page of another origin — the chat app's own web client, the normal case — uses the hub in headless
Chromium: it imports the JavaScript client from the hub's ``/client/redpacket.js``, calls the user API
with a token its own backend made, opens the websocket and grabs. A page of an origin not in
``REDPACKET_ALLOWED_ORIGINS`` gets nothing: its preflight is 403 ``origin_not_allowed``, nothing it is
sent carries an ``Access-Control-Allow-Origin``, and the chat backend's ``/api/service/`` routes answer no
page at all. Each page is served by a server of its own on loopback, like the hub (a page of a public
origin reaching a loopback address is Chromium's Local Network Access question, not CORS)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from playwright.async_api import Browser

from server import errors
from server.hub.tokens import make_token
from server.settings import Settings
from tests.hubtools import HubUnderTest, hub_in_process
from tests.webtools import WAIT_MS

# The chat app's page: the client from the hub, the caller's user over HTTP (ids as strings, as the
# websocket's), then a grab. Whatever fails is said in ``window.result.error``.
PAGE = """<!doctype html><title>chat app</title><script type="module">
const { HUB, WS, TOKEN, GROUP, PACKET } = %s;
window.result = (async () => {
  const { RedPacketClient } = await import(HUB + "/client/redpacket.js");
  const headers = { authorization: "Bearer " + TOKEN, "redpacket-ids": "string" };
  const me = await (await fetch(HUB + "/api/me", { headers })).json();
  const client = new RedPacketClient({ url: WS, token: TOKEN, reconnect: false });
  await client.connect();
  const share = await client.grab(GROUP, PACKET);
  client.close();
  return { user: me.user_id, outcome: share.outcome, amount: share.amount };
})().catch((e) => ({ error: String(e) }));
</script>"""


@asynccontextmanager
async def page_server(values: dict[str, str]) -> AsyncIterator[str]:
    """A web server of its own answering every request with the chat app's page (given ``values`` as
    they are at the request): its origin."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        body = (PAGE % json.dumps(values)).encode()
        head = f"HTTP/1.1 200 OK\r\ncontent-type: text/html\r\ncontent-length: {len(body)}\r\n"
        writer.write(head.encode() + b"connection: close\r\n\r\n" + body)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


async def run_page(browser: Browser, origin: str) -> dict[str, Any]:
    """The page of ``origin``; what its script ended with."""
    context = await browser.new_context()
    context.set_default_timeout(WAIT_MS)
    try:
        page = await context.new_page()
        await page.goto(f"{origin}/")
        await page.wait_for_function("window.result !== undefined")
        result: dict[str, Any] = await page.evaluate("window.result")
        return result
    finally:
        await context.close()


async def test_a_page_of_an_allowed_origin_uses_the_hub_and_another_origin_gets_nothing(
    browser: Browser, hub_settings: Settings
) -> None:
    page: dict[str, str] = {}  # what the pages' script is given, once the hub has made it
    async with page_server(page) as chat_app, page_server(page) as elsewhere:
        async with hub_in_process(hub_settings.replace(allowed_origins=f"self,{chat_app}")) as hub:
            page.update(await a_packet_for_bob(hub))
            answer = await run_page(browser, chat_app)
            assert answer == {"user": page["BOB"], "outcome": "won", "amount": 300}, answer

            refused = await run_page(browser, elsewhere)
            assert "error" in refused and "fetch" in refused["error"].lower(), refused

            async with httpx.AsyncClient(base_url=hub.http) as http:
                ask = {
                    "access-control-request-method": "GET",
                    "access-control-request-headers": "authorization",
                }
                ok = await http.options("/api/me", headers={"origin": chat_app, **ask})
                assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == chat_app
                assert "redpacket-ids" in ok.headers["access-control-allow-headers"].lower()
                assert "access-control-allow-credentials" not in ok.headers  # no cookies: tokens only
                no = await http.options("/api/me", headers={"origin": elsewhere, **ask})
                assert no.status_code == 403 and no.json()["error"]["code"] == errors.ORIGIN_NOT_ALLOWED
                for origin, marked in ((chat_app, True), (elsewhere, False)):
                    script = await http.get("/client/redpacket.js", headers={"origin": origin})
                    assert script.status_code == 200
                    assert (script.headers.get("access-control-allow-origin") == origin) is marked, origin
                # Nothing but the user routes, the client and the API's description: not the metrics.
                metrics = await http.get("/metrics", headers={"origin": chat_app})
                assert "access-control-allow-origin" not in metrics.headers
                # The chat backend's routes answer no page, listed or not: its key never belongs in a browser.
                service = await http.options("/api/service/topup", headers={"origin": chat_app, **ask})
                assert "access-control-allow-origin" not in service.headers


async def a_packet_for_bob(hub: HubUnderTest) -> dict[str, str]:
    """Alice's one-share packet of 300 cents in a group with bob; the page's values, bob's token made
    as the chat app's backend makes one (HS256 with the shared secret)."""
    _, alice_token = await hub.login("alice")
    bob, _ = await hub.login("bob")
    await hub.api("POST", "/api/topup", alice_token, amount=1_000, request_id="cors-topup")
    group = (await hub.api("POST", "/api/groups", alice_token, name="cors"))["group_id"]
    await hub.api("POST", f"/api/groups/{group}/members", alice_token, user_ids=[bob])
    async with await hub.client(alice_token, "json") as alice:
        packet = (await alice.request("send", group=group, total=300, count=1))["packet_id"]
    token = make_token(hub.settings.secret.encode(), bob, int(time.time()), 600)
    values = {"HUB": hub.http, "WS": hub.ws, "TOKEN": token, "GROUP": str(group), "PACKET": str(packet)}
    return {**values, "BOB": str(bob)}
