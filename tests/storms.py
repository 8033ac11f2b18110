"""A storm of sends and grabs through two hubs while a test breaks what is under them (a Galera node, a
Spider backend, a Redis master): the people and groups it runs on, the senders and grabbers that retry
as clients do, and the ``Storm`` that keeps what every user was told and when."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from websockets.exceptions import ConnectionClosed

from redpacket_client.connection import HubClient, HubError
from server import errors
from tests.hubtools import HubUnderTest


@dataclass
class Storm:
    """What the users were told: every packet sent (answered), every grab answered "won"; and when."""

    sent: dict[str, int] = field(default_factory=dict)  # request id -> packet id
    told: dict[tuple[int, int], int] = field(default_factory=dict)  # (packet, user) -> amount
    send_ok_at: list[tuple[float, float]] = field(default_factory=list)  # (asked, answered)
    send_errors_at: list[float] = field(default_factory=list)
    killed_at: float = 0.0
    stop: asyncio.Event = field(default_factory=asyncio.Event)


async def storm_world(hub: HubUnderTest, groups: int = 4) -> tuple[str, list[tuple[int, str]], list[int]]:
    """A storm's people through ``hub``: an admin with money (its token), 24 members (id, token) and
    ``groups`` groups of them all."""
    _, admin_token = await hub.login("admin")
    await hub.api("POST", "/api/topup", admin_token, amount=1_000_000, request_id="seed")
    people = [await hub.login(f"p{i}") for i in range(24)]
    group_ids = []
    for i in range(groups):
        g = (await hub.api("POST", "/api/groups", admin_token, name=f"g{i}"))["group_id"]
        await hub.api("POST", f"/api/groups/{g}/members", admin_token, user_ids=[u for u, _ in people])
        group_ids.append(g)
    return admin_token, people, group_ids


async def sender(
    hub: HubUnderTest, token: str, groups: list[int], storm: Storm, grabs: asyncio.Queue[Any]
) -> None:
    """Packets one after another, each retried with its request id until answered (a retry of a send
    whose outcome was unknown is a replay: the packet once)."""
    n = 0
    while not storm.stop.is_set():
        rid, g = f"s{n}", groups[n % len(groups)]
        deadline = time.monotonic() + 60
        while True:
            assert time.monotonic() < deadline, f"send {rid} not answered within 60 s"
            asked = time.monotonic()
            try:
                async with await HubClient.connect(hub.ws, token) as c:
                    got = await c.request("send", group=g, total=600, count=6, request_id=rid)
                storm.sent[rid] = got["packet_id"]
                storm.send_ok_at.append((asked, time.monotonic()))
                await grabs.put((g, got["packet_id"]))
                break
            except HubError as e:
                assert e.code in (errors.DATABASE_UNAVAILABLE, errors.RATE_LIMITED), e
                storm.send_errors_at.append(time.monotonic())
            except (OSError, ConnectionClosed):
                pass
            await asyncio.sleep(0.05)  # (a client's pause before its retry: nothing is waited for)
        n += 1


async def _grab(hub: HubUnderTest, token: str, group: int, packet: int, user: int, storm: Storm) -> None:
    """One member's grab, asked again (a new socket) until answered: a grab asked twice is answered
    the same."""
    deadline = time.monotonic() + 60
    while True:
        assert time.monotonic() < deadline, "a grab not answered within 60 s"
        try:
            async with await HubClient.connect(hub.ws, token) as c:
                got = await c.request("grab", group=group, packet=packet)
            storm.told[(packet, user)] = got["amount"]
            return
        except HubError as e:
            assert e.code in (errors.REDIS_UNAVAILABLE, errors.RATE_LIMITED), e
        except (OSError, ConnectionClosed):
            pass
        await asyncio.sleep(0.05)  # (a client's pause before its retry: nothing is waited for)


async def grabber(
    hubs: tuple[HubUnderTest, HubUnderTest],
    people: list[tuple[int, str]],
    storm: Storm,
    grabs: asyncio.Queue[Any],
) -> None:
    """Each packet grabbed by six members (its six shares), half through each hub."""
    while True:
        g, packet = await grabs.get()
        takers = [people[(packet * 7 + i) % len(people)] for i in range(6)]
        await asyncio.gather(*(_grab(hubs[i % 2], t, g, packet, u, storm) for i, (u, t) in enumerate(takers)))
        grabs.task_done()
