"""A chat backend's webhook endpoint for tests: a real receiver over HTTP that checks every signature
with the code docs/integration.md gives and answers as its script says, and the settings of a hub and
worker that deliver to it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from server.settings import Settings
from tests.chatbackend import KEY
from tests.hubtools import eventually
from tests.repofiles import ROOT, guide_example

SECRET = "webhook-secret-of-the-chat-backend-0123456789"
# Secrets of endpoints of their own (REDPACKET_WEBHOOK_ENDPOINTS): one's own, and another one's.
OWN = "own-secret-of-the-wallet-receiver-0123456789"
OTHER = "another-secret-of-a-receiver-012345678901"


def verifier() -> Callable[..., bool]:
    """The receiver's check, exactly as docs/integration.md gives it."""
    scope: dict[str, Any] = {}
    exec(guide_example("webhook-verify-python"), scope)
    return scope["verify_webhook"]  # type: ignore[no-any-return]


def webhook_schema() -> dict[str, Any]:
    """The body docs/openapi.json's ``webhooks.event`` describes, with the document's components."""
    doc = json.loads((ROOT / "docs" / "openapi.json").read_text())
    body = doc["webhooks"]["event"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    return {**body, "components": doc["components"]}


@dataclass
class Receiver:
    """A backend's webhook endpoint. ``script`` says how the next requests are answered: ``"500"``,
    ``"slow"`` (answered after the dispatcher's timeout), ``"hold"`` (not answered until ``release``);
    then 200 for every request."""

    script: list[str] = field(default_factory=list)
    verify: Callable[..., bool] = field(default_factory=verifier)
    seen: list[tuple[int, str]] = field(default_factory=list)  # (event id, how it was answered)
    accepted: dict[int, dict[str, Any]] = field(default_factory=dict)  # deduped by event id
    order: list[int] = field(default_factory=list)  # event ids in the order first accepted
    bad_signatures: int = 0
    traceparents: dict[int, str] = field(default_factory=dict)  # event id → the W3C header it came with
    holding: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    url: str = ""

    async def endpoint(self, request: Request) -> Response:
        body = await request.body()
        if not self.verify(SECRET, request.headers.get("redpacket-signature", ""), body):
            self.bad_signatures += 1
            return Response(status_code=400)
        event = json.loads(body)
        assert request.headers["redpacket-event-id"] == str(event["id"])
        self.traceparents[event["id"]] = request.headers.get("traceparent", "")
        how = self.script.pop(0) if self.script else "ok"
        self.seen.append((event["id"], how))
        if how == "500":
            return Response("busy", status_code=500)
        if how == "slow":
            await asyncio.sleep(3)  # the test's dispatcher gives up after 0.4 s
        if how == "hold":
            self.holding.set()
            await self.release.wait()
        if event["id"] not in self.accepted:  # the backend's dedupe
            self.accepted[event["id"]] = event
            self.order.append(event["id"])
        return Response("ok")


@contextlib.asynccontextmanager
async def receiving(receiver: Receiver) -> AsyncIterator[Receiver]:
    """``receiver`` served by uvicorn on a free port of this machine (its ``url`` set) while in the block."""
    app = Starlette(routes=[Route("/hooks", receiver.endpoint, methods=["POST"])])
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    await eventually(lambda: server.started, timeout=30)
    receiver.url = f"http://127.0.0.1:{sock.getsockname()[1]}/hooks"
    try:
        yield receiver
    finally:
        receiver.release.set()
        server.should_exit = True
        await asyncio.wait_for(task, 30)


def hooked(settings: Settings, receiver: Receiver) -> Settings:
    """``settings`` of a hub and worker that take the chat backend's key and deliver every event to
    ``receiver``, retrying fast and giving up on an answer after 0.4 s."""
    return settings.replace(
        service_key=KEY,
        demo_topup=False,
        webhook_urls=receiver.url,
        webhook_secret=SECRET,
        webhook_retry_ms=20,
        webhook_timeout_ms=400,
    )
