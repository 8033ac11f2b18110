"""Hostile input from anyone, most of it before logging in: odd tokens, odd text, ids out of range,
oversized and never-finished handshakes. Each gets a clear answer and moves no money."""

from __future__ import annotations

import asyncio
from urllib.parse import quote

import httpx
import pytest
import websockets
from websockets.exceptions import ConnectionClosed

from server import protocol, tokens
from server.settings import Settings
from tests.hubtools import HubUnderTest, hub_in_process
from tests.test_hub import make_room


@pytest.fixture
async def h(hub_settings: Settings) -> HubUnderTest:
    async with hub_in_process(hub_settings) as hub:
        yield hub  # type: ignore[misc]


def test_tokens_of_other_scripts_and_shapes_are_malformed_not_errors() -> None:
    secret = b"s"
    good = tokens.make_token(secret, 7, 1_000, 60)
    user, expires, sig = good.split(".")
    for bad in [
        f"{user}.{expires}.{sig[:-1]}é",  # non-ASCII signature: hmac.compare_digest raised TypeError
        f"².{expires}.{sig}",  # str.isdigit() is true for "²", int() is not
        f"١.{expires}.{sig}",  # Arabic-Indic digit one
        f"{user}.{expires}.{sig.upper()}",
        f"{2**63}.{expires}.{sig}",  # past a signed 64-bit id
        f"0{user}.{expires}.{sig}",
        f" {good}",
    ]:
        with pytest.raises(tokens.TokenError) as e:
            tokens.verify_token(secret, bad, 1_000)
        assert e.value.code == "token_invalid", bad
    assert tokens.verify_token(secret, good, 1_000) == 7


async def _refused_with(url: str) -> tuple[int, str]:
    async with websockets.connect(url, subprotocols=[protocol.SUBPROTOCOL_JSON]) as ws:  # type: ignore[list-item]
        with pytest.raises(ConnectionClosed) as e:
            await asyncio.wait_for(ws.recv(), 10)
    assert e.value.rcvd is not None
    return e.value.rcvd.code, e.value.rcvd.reason


async def test_a_non_ascii_token_closes_with_4001(h: HubUnderTest) -> None:
    uid, token = await h.login("li")
    user, expires, sig = token.split(".")
    bad_tokens = [f"{user}.{expires}.{sig[:-1]}é", f"²{user}.{expires}.{sig}", "红包.1.2"]
    for bad in bad_tokens:
        assert await _refused_with(f"{h.ws}?token={quote(bad)}") == (4001, "token_invalid")
    # Over HTTP the header's bytes arrive as Latin-1 text: refused the same way, as a JSON error.
    async with httpx.AsyncClient(base_url=h.http, timeout=10) as http:
        for bad in bad_tokens:
            header = b"Bearer " + bad.encode()
            r = await http.get("/api/me", headers={"authorization": header})
            assert r.status_code == 401 and r.json()["error"]["code"] == "token_invalid"
