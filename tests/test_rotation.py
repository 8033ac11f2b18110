"""Rolling the chat backend's secrets as docs/integration.md says, while they are used: the service key
across two hubs restarted one by one under a stream of calls (not one refused), and the webhook secret
across a dispatcher's restarts while deliveries flow (each one verifiable, with the receiver code the
guide gives, by a receiver holding either secret while both are in force)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.requests import Request
from starlette.responses import Response

from server.core import Core, open_core
from server.money import ledger
from server.settings import Settings
from tests.chatbackend import NEW, OLD
from tests.hubtools import eventually, free_port, hub_in_process
from tests.webhooktools import Receiver, receiving
from worker.webhooks import Dispatcher


def previous_key_uses(metrics_page: str) -> float:
    for family in text_string_to_metric_families(metrics_page):
        for sample in family.samples:
            if sample.name == "redpacket_service_key_uses_total" and sample.labels == {"key": "previous"}:
                return sample.value
    raise AssertionError("no redpacket_service_key_uses_total{key=previous} on the hub's /metrics")


async def test_the_service_key_rolls_across_two_hubs_under_calls_with_none_refused(
    hub_settings: Settings,
) -> None:
    base = hub_settings.replace(dev_login=False, demo_topup=False)
    ports = [free_port(), free_port()]
    backend = {"key": OLD}  # what the chat backend sends
    answers: Counter[int] = Counter()
    stop = asyncio.Event()

    async def calls() -> None:
        """The backend's calls, to either hub in turn (one restarting: on to the other, as a balancer)."""
        n = 0
        async with httpx.AsyncClient(timeout=10) as http:
            while not stop.is_set():
                n += 1
                url = f"http://127.0.0.1:{ports[n % 2]}/api/service/users/{7000 + n % 40}"
                try:
                    r = await http.put(
                        url,
                        json={"name": f"u{n % 40}"},
                        headers={"authorization": f"Bearer {backend['key']}"},
                    )
                except httpx.TransportError:
                    continue
                answers[r.status_code] += 1

    async with contextlib.AsyncExitStack() as stack:
        hubs = [contextlib.AsyncExitStack(), contextlib.AsyncExitStack()]
        stack.push_async_callback(lambda: hubs[0].aclose())
        stack.push_async_callback(lambda: hubs[1].aclose())

        async def start(i: int, key: str, previous: str = "") -> None:
            await hubs[i].aclose()
            hubs[i] = contextlib.AsyncExitStack()
            settings = base.replace(service_key=key, service_key_previous=previous)
            await hubs[i].enter_async_context(hub_in_process(settings, port=ports[i]))

        await start(0, OLD)
        await start(1, OLD)
        task = asyncio.create_task(calls())

        async def a_while() -> None:  # some calls to each hub in every step
            seen = sum(answers.values())
            await eventually(lambda: sum(answers.values()) >= seen + 40, timeout=60)

        try:
            await a_while()
            await start(1, NEW, OLD)  # hub by hub: both keys taken
            await a_while()
            await start(0, NEW, OLD)
            await a_while()
            async with httpx.AsyncClient() as http:  # the old key, still in use, came in as "previous"
                page = (await http.get(f"http://127.0.0.1:{ports[0]}/metrics")).text
            assert previous_key_uses(page) > 0
            backend["key"] = NEW  # the backend moves
            await a_while()
            await start(1, NEW)  # the old key dropped
            await a_while()
            await start(0, NEW)
            await a_while()
        finally:
            stop.set()
            await task
        assert set(answers) == {200}, answers  # not one call refused through the roll
        async with httpx.AsyncClient() as http:  # and the old key is no key any more
            r = await http.get(
                f"http://127.0.0.1:{ports[0]}/api/service/accounts/7001",
                headers={"authorization": f"Bearer {OLD}"},
            )
        assert r.status_code == 401


@dataclass
class RollingReceiver(Receiver):
    """A receiver holding one secret at a time (``holds``), checking each delivery with the guide's code;
    for each, whether the old and the new secret each verify it."""

    holds: str = OLD
    checked: list[tuple[bool, bool]] = field(default_factory=list)

    async def endpoint(self, request: Request) -> Response:
        body = await request.body()
        signature = request.headers.get("redpacket-signature", "")
        self.checked.append((self.verify(OLD, signature, body), self.verify(NEW, signature, body)))
        if not self.verify(self.holds, signature, body):
            self.bad_signatures += 1
            return Response(status_code=400)
        event: dict[str, Any] = json.loads(body)
        self.accepted.setdefault(event["id"], event)
        return Response("ok")


@pytest.mark.parametrize("core", ["mysql"], indirect=True)
async def test_the_webhook_secret_rolls_with_every_delivery_verifiable_by_either_holder(core: Core) -> None:
    user = await ledger.create_user(core.db, "rolling")
    async with receiving(RollingReceiver()) as rx, httpx.AsyncClient() as http:
        assert isinstance(rx, RollingReceiver)
        base = core.settings.replace(webhook_urls=rx.url, webhook_timeout_ms=2000, webhook_retry_ms=20)
        made = 0

        async def deliver(secret: str, previous: str = "") -> list[tuple[bool, bool]]:
            """Five more events, delivered by a dispatcher signing with ``secret`` (and ``previous``)."""
            nonlocal made
            for _ in range(5):
                made += 1
                await ledger.topup(core.db, user, 100, f"roll-{made}")
            first = len(rx.checked)
            settings = base.replace(webhook_secret=secret, webhook_secret_previous=previous)
            async with open_core(settings) as worker_core:
                dispatcher = Dispatcher(worker_core, client=http)

                async def until_accepted() -> None:
                    while len(rx.accepted) < made:
                        await dispatcher.round()

                await asyncio.wait_for(until_accepted(), 60)
            return rx.checked[first:]

        before = await deliver(OLD)
        rx.holds = OLD
        during_old_holder = await deliver(NEW, OLD)  # workers rolled; the receiver not yet
        rx.holds = NEW
        during_new_holder = await deliver(NEW, OLD)  # the receiver moved
        after = await deliver(NEW)  # the old secret dropped
    assert rx.bad_signatures == 0 and len(rx.accepted) == made == 20
    assert before and all(c == (True, False) for c in before)
    assert during_old_holder and during_new_holder
    assert all(c == (True, True) for c in during_old_holder + during_new_holder)  # either holder verifies
    assert after and all(c == (False, True) for c in after)
