"""What a request passes before its handler runs, kept by each hub process in its own memory: who a token
names (``Tokens``, with the backend's JWKS when it publishes its keys), and the limits by client address
and by user on the HTTP API, by wrong service key on the chat backend's API, and by user across all of a
user's sockets on the websocket (docs/configuration.md), and the answer to a wrong service or console key
(``refuse_wrong_key``). The routes read it as ``app.state.guards``; the
hub's registry of sockets, its fan-out and its presence (``server.hub.hub``) never do."""

from __future__ import annotations

import contextlib
from typing import NoReturn

from starlette.requests import Request

from server import errors
from server.hub.httpkit import client_address, limit
from server.hub.ratelimit import KeyedBuckets
from server.hub.tokens import Rules, TokenError, Tokens
from server.settings import Settings


class Guards:
    def __init__(self, settings: Settings) -> None:
        self.tokens = Tokens(Rules.from_settings(settings))
        st = settings
        self.user_msgs = KeyedBuckets(st.user_msgs_per_second, st.user_msgs_burst)
        self.http_by_address = KeyedBuckets(st.http_per_address_per_second, st.http_per_address_burst)
        self.http_by_user = KeyedBuckets(st.http_per_user_per_second, st.http_per_user_burst)
        n = st.service_key_failures_per_minute
        self.service_key_failures = KeyedBuckets(n / 60, n)
        # Wrong console keys (the operators' own, REDPACKET_CONSOLE_KEY): as few.
        self.console_key_failures = KeyedBuckets(n / 60, n)

    async def start(self) -> None:
        """Fetch the backend's keys before the first token needs them (a failure is said in a warning
        line, and tried again on demand)."""
        if self.tokens.jwks is not None:
            with contextlib.suppress(Exception):
                await self.tokens.jwks.refresh()


def refuse_wrong_key(request: Request, buckets: KeyedBuckets, what: str, said: str) -> NoReturn:
    """A wrong key (``what``: ``service_key``, ``console_key``) from the request's address: 401
    ``token_invalid`` saying ``said``; past the address's allowance of wrong keys, 429 until it refills
    (counted in ``redpacket_hub_limited_total{limit=what}``). The right key is taken whatever an address
    did before: a stranger behind the same address (a proxy, a NAT) cannot lock its owner out, and a key
    of 32 random characters is not guessed."""
    wait = f"too many wrong {what.replace('_', ' ')}s from this address: wait a minute"
    limit(request, what, buckets, client_address(request), wait)
    raise TokenError(errors.TOKEN_INVALID, said)
