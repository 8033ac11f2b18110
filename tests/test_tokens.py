"""JWT tokens on a real hub: a hub taking RS256 tokens opens its socket and HTTP API to them and to no
others (each pure check of a token: ``tests/unit/test_tokens.py``)."""

from __future__ import annotations

import pytest
from websockets.exceptions import ConnectionClosed

from redpacket_client.connection import HubClient
from server.hub import protocol
from server.hub.tokens import make_token
from server.money import ledger
from server.settings import Settings
from tests.hubtools import hub_in_process
from tests.jwts import RSA, RSA_PUBLIC, now, signed


async def test_a_hub_taking_rs256_tokens_opens_sockets_and_the_api_for_them_and_no_others(
    hub_settings: Settings,
) -> None:
    s = hub_settings.replace(jwt_public_key=RSA_PUBLIC, jwt_audience="redpacket", dev_login=True)
    async with hub_in_process(s) as hub:
        assert (await hub.api("POST", "/api/login", name="li"))["error"]["code"] == "disabled"
        ours = signed(RSA, "RS256", sub="9001", aud="redpacket")
        me = await hub.api("GET", "/api/me", ours)
        assert me["error"]["code"] == "user_not_found"  # a valid token; the user is not provisioned
        for bad, code in [
            (make_token(s.secret.encode(), 9001, now(), 600), "token_invalid"),  # HS256 to an RS256 hub
            (signed(RSA, "RS256", sub="9001"), "token_invalid"),  # no audience
            (signed(RSA, "RS256", sub="9001", aud="redpacket", exp=now() - 120), "token_expired"),
        ]:
            assert (await hub.api("GET", "/api/me", bad))["error"]["code"] == code
            with pytest.raises(ConnectionClosed) as closed:
                c = await HubClient.connect(hub.ws, bad)
                await c.next_event()
            assert closed.value.rcvd is not None
            assert (closed.value.rcvd.code, closed.value.rcvd.reason) == (protocol.CLOSE_UNAUTHORIZED, code)
        with pytest.raises(ConnectionClosed) as closed:  # valid, but nobody put user 9001 yet
            c = await HubClient.connect(hub.ws, ours)
            await c.next_event()
        assert closed.value.rcvd is not None
        assert (closed.value.rcvd.code, closed.value.rcvd.reason) == (
            protocol.CLOSE_USER_UNKNOWN,
            "user_not_found",
        )
        assert await ledger.put_user(hub.core.db, 9001, "li") == "created"  # the backend puts it
        assert (await hub.api("GET", "/api/me", ours))["user_id"] == 9001
        client = await HubClient.connect(hub.ws, ours)
        assert client.welcome["user"] == 9001
        await client.close()
