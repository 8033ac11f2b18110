"""The chat app's backend as the hub's service API (``/api/service/*``) sees it: its key, ids of its own,
the tokens it gives its users, and its calls. The hub that takes this key is ``tests/conftest.py``'s
``service_hub``."""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING, Any

import httpx

from server.hub.tokens import make_token

if TYPE_CHECKING:
    from tests.hubtools import HubUnderTest

KEY = "service-key-of-the-chat-backend-0123456789"
# Two secrets of the backend's while it rolls one to the other (docs/integration.md): a service key, or
# a webhook secret.
OLD = "the-chat-backends-old-secret-0123456789abcdef"
NEW = "the-chat-backends-new-secret-fedcba9876543210"


class Backend:
    """The chat app's backend: the key, and ids of its own."""

    def __init__(self, hub: HubUnderTest, key: str = KEY) -> None:
        self.hub = hub
        self.key = key
        self.base = random.randrange(10**12, 10**15)  # ids no other test uses

    def id(self, n: int) -> int:
        return self.base + n

    async def call(self, method: str, path: str, key: str | None = None, **body: Any) -> tuple[int, Any]:
        key = self.key if key is None else key
        headers = {"authorization": f"Bearer {key}"} if key else {}
        async with httpx.AsyncClient(base_url=self.hub.http, timeout=30) as http:
            r = await http.request(method, path, json=body or None, headers=headers)
        return r.status_code, r.json()

    async def ok(self, method: str, path: str, **body: Any) -> Any:
        status, data = await self.call(method, path, **body)
        assert status == 200, data
        return data

    def token(self, n: int) -> str:
        """What the backend gives its user ``n``: a JWT signed with the shared secret."""
        return make_token(self.hub.settings.secret.encode(), self.id(n), int(time.time()), 600)

    async def pulled(self) -> list[dict[str, Any]]:
        """Every event, through the events API, page by page."""
        out: list[dict[str, Any]] = []
        after = 0
        while True:
            page = await self.ok("GET", f"/api/service/events?after={after}&limit=7")
            out += page["events"]
            after = page["next"]
            if not page["more"]:
                return out
