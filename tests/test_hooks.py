"""The chat backend's hook before money moves, on a real hub: the receiver docs/integration.md gives (run
as written, its signature check included) allows, denies with its reason and changes a greeting; a hook
that never answers and one that is down make money out ``hook_unavailable`` always and a send as
``REDPACKET_HOOK_SENDS_WHEN_DOWN`` says. No money moves on a refusal, a retry of what was done is not
asked again, and the books reconcile."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from redpacket_client.connection import HubClient, HubError
from server.core import open_core
from server.hub.tokens import make_token
from server.money.reconcile import reconcile
from server.settings import Settings
from tests.chatbackend import KEY
from tests.hubtools import HubUnderTest, eventually, free_port, hub_in_process
from tests.repofiles import guide_example

HOOK_SECRET = "hook-secret-of-the-chat-backend-0123456789ab"


@contextlib.asynccontextmanager
async def serving(app: Any) -> AsyncIterator[str]:
    """``app`` on a port of its own: its address."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    await eventually(lambda: server.started, timeout=30)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        server.force_exit = True  # (the hook that never answers holds its request)
        await asyncio.wait_for(task, 30)


def guide_receiver() -> dict[str, Any]:
    """The guide's receiver, run as written: its module's names (``app``, ``needs_kyc``...)."""
    scope: dict[str, Any] = {}
    os.environ["REDPACKET_HOOK_SECRET"] = HOOK_SECRET
    try:
        exec(guide_example("webhook-verify-python"), scope)
        exec(guide_example("hook-receiver-python"), scope)
    finally:
        del os.environ["REDPACKET_HOOK_SECRET"]
    return scope


class World:
    """Users put and funded over the service API: an admin (1) and a member (2) in one group."""

    def __init__(self, hub: HubUnderTest, base: int) -> None:
        self.hub, self.base = hub, base

    def id(self, n: int) -> int:
        return self.base + n

    async def call(self, method: str, path: str, **body: Any) -> tuple[int, Any]:
        async with httpx.AsyncClient(base_url=self.hub.http, timeout=30) as http:
            r = await http.request(method, path, json=body, headers={"authorization": f"Bearer {KEY}"})
        return r.status_code, r.json()

    async def ok(self, method: str, path: str, **body: Any) -> Any:
        status, data = await self.call(method, path, **body)
        assert status == 200, data
        return data

    async def make(self) -> None:
        for n in (1, 2):
            await self.ok("PUT", f"/api/service/users/{self.id(n)}", name=f"h{self.base}-{n}")
        group = f"/api/service/groups/{self.id(100)}"
        await self.ok("PUT", group, name="g", members=[self.id(2)], admins=[self.id(1)], version=1)
        await self.ok(
            "POST", "/api/service/topup", user_id=self.id(1), amount=90_000, request_id=f"t{self.base}"
        )

    async def balance(self) -> int:
        return int((await self.ok("GET", f"/api/service/accounts/{self.id(1)}"))["balance"])

    async def withdraw(self, amount: int, rid: str) -> tuple[int, Any]:
        return await self.call(
            "POST", "/api/service/withdraw", user_id=self.id(1), amount=amount, request_id=rid
        )

    async def send(self, rid: str, greeting: str = "恭喜") -> dict[str, Any]:
        token = self.hub_token(1)
        async with await HubClient.connect(self.hub.ws, token) as c:
            return await c.request(
                "send", group=self.id(100), total=300, count=2, greeting=greeting, request_id=rid
            )

    def hub_token(self, n: int) -> str:
        return make_token(self.hub.settings.secret.encode(), self.id(n), int(time.time()), 600)


def hooked(settings: Settings, url: str, **extra: Any) -> Settings:
    return settings.replace(
        service_key=KEY, demo_topup=False, hook_url=url, hook_secret=HOOK_SECRET, hook_timeout_ms=300, **extra
    )


def answers(page: str, answer: str) -> float:
    """The hub's count of the hook's answers of one kind, over every type asked."""
    total = 0.0
    for line in page.splitlines():
        if line.startswith("redpacket_hook_answers_total{") and f'answer="{answer}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


async def test_the_guides_receiver_allows_denies_and_changes_and_no_refusal_moves_money(
    hub_settings: Settings,
) -> None:
    receiver = guide_receiver()
    async with serving(receiver["app"]) as hook_base:
        async with hub_in_process(hooked(hub_settings, f"{hook_base}/hook")) as hub:
            w = World(hub, 5_000_000 + free_port())
            await w.make()
            # Allowed, and allowed with a changed greeting.
            sent = await w.send("s1")
            assert sent["greeting"] == "恭喜"
            changed = await w.send("s2", greeting="see http://spam.example")
            assert changed["greeting"] == "恭喜发财"
            # Its retry (a client that lost the answer sends the same frame): the packet that was sent.
            again = await w.send("s2", greeting="see http://spam.example")
            assert (again["packet_id"], again["replay"]) == (changed["packet_id"], True)
            assert await w.balance() == 90_000 - 600
            # Over the limit, and a user who must verify first: refused with the backend's reason.
            status, refused = await w.withdraw(60_000, "w-big")
            assert (status, refused["error"]["code"], refused["error"]["reason"]) == (
                403,
                "denied_by_backend",
                "over_limit",
            )
            status, done = await w.withdraw(1_000, "w-ok")
            assert status == 200 and done["replay"] is False
            receiver["needs_kyc"].add(w.id(1))
            with pytest.raises(HubError) as denied:
                await w.send("s3")
            assert (denied.value.code, denied.value.details.get("reason")) == (
                "denied_by_backend",
                "kyc_required",
            )
            assert "Verify your identity" in denied.value.message
            # A retry of a withdrawal already made answers it, not asked again (the hook would now say no).
            status, again = await w.withdraw(1_000, "w-ok")
            assert status == 200 and again["replay"] is True
            assert await w.balance() == 90_000 - 600 - 1_000  # nothing moved on any refusal
            async with httpx.AsyncClient() as http:
                page = (await http.get(f"{hub.http}/metrics")).text
            assert answers(page, "denied") == 2 and answers(page, "changed") == 1
        async with open_core(hub.settings) as core:
            assert (await reconcile(core)).ok


async def test_a_hook_that_never_answers_or_is_down_refuses_money_out_and_sends_by_the_setting(
    hub_settings: Settings,
) -> None:
    never = asyncio.Event()

    async def silent(request: Request) -> Response:
        await never.wait()  # answers nothing until the test ends: the hub's deadline decides
        return Response("late")

    async with serving(Starlette(routes=[Route("/hook", silent, methods=["POST"])])) as silent_base:
        down = f"http://127.0.0.1:{free_port()}/hook"  # nothing listens there
        for url in (f"{silent_base}/hook", down):
            for when_down in ("deny", "allow"):
                settings = hooked(hub_settings, url, hook_sends_when_down=when_down)
                async with hub_in_process(settings) as hub:
                    w = World(hub, 6_000_000 + free_port())
                    await w.make()
                    status, refused = await w.withdraw(1_000, "w")
                    assert (status, refused["error"]["code"]) == (503, "hook_unavailable"), url
                    if when_down == "deny":
                        with pytest.raises(HubError) as unavailable:
                            await w.send("s")
                        assert unavailable.value.code == "hook_unavailable"
                        assert await w.balance() == 90_000
                    else:
                        await w.send("s")  # sent unchecked, as the operator chose
                        assert await w.balance() == 90_000 - 300
        never.set()
