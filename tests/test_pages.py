"""Every list of the HTTP API pages one way (server.hub.httpkit.page; docs/integration.md, "Lists"):
``?after=&limit=`` in; the items, ``next`` (never null) and ``more`` out; a cursor past the end refused
alike. Walked one item at a time, each list gives what one large page gives, in the same order."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from redpacket_client.connection import HubClient
from server.hub.tokens import make_token
from tests.chatbackend import Backend
from tests.hubtools import HubUnderTest, eventually

Get = Callable[[str], Awaitable[tuple[int, Any]]]


async def walk(get: Get, path: str, name: str, cursor: str, most: int, start: int = 0) -> list[Any]:
    """The list at ``path`` after ``start`` read one item a page, each page checked against the
    convention, and the same list read in one page: both must agree."""
    items: list[Any] = []
    after = start
    while True:
        status, page = await get(f"{path}?after={after}&limit=1")
        assert status == 200, page
        assert len(page[name]) <= 1 and page["next"] == (page[name][-1][cursor] if page[name] else after)
        assert page[name] or after == start, page  # a page after one that said "more" has an item
        items += page[name]
        if not page["more"]:
            break
        after = page["next"]
    status, whole = await get(f"{path}?after={start}&limit={most}")
    assert status == 200 and whole[name] == items and whole["more"] is False, whole
    return items


async def test_every_list_pages_one_way(service_hub: HubUnderTest) -> None:
    b = Backend(service_hub)
    before = (await b.ok("GET", "/api/service/events?after=0&limit=1"))["next"]
    while (page := await b.ok("GET", f"/api/service/events?after={before}&limit=500"))["more"]:
        before = page["next"]  # (the feed is shared with other tests: this one's events come after it)
    before = page["next"]
    for n in (1, 2):
        await b.ok("PUT", f"/api/service/users/{b.id(n)}", name=f"pager{n}-{b.base}")
    group = b.id(100)
    await b.ok(
        "PUT", f"/api/service/groups/{group}", name="g", members=[b.id(2)], admins=[b.id(1)], version=1
    )
    for r in range(3):
        await b.ok("POST", "/api/service/topup", user_id=b.id(1), amount=1_000, request_id=f"t{b.base}-{r}")
    grabber = await HubClient.connect(service_hub.ws, b.token(2))
    await grabber.sync()
    sent = []
    for r in range(3):
        body = dict(sender_id=b.id(1), group_id=group, total=100, count=1, request_id=f"s{b.base}-{r}")
        sent.append((await b.ok("POST", "/api/service/packets", **body))["packet_id"])
        await grabber.request("grab", group=group, packet=sent[-1])
    await grabber.close()

    async def as_user(n: int) -> Get:
        token = make_token(service_hub.settings.secret.encode(), b.id(n), 0, 10**10)

        async def get(path: str) -> tuple[int, Any]:
            async with httpx.AsyncClient(base_url=service_hub.http, timeout=30) as http:
                r = await http.get(path, headers={"authorization": f"Bearer {token}"})
            return r.status_code, r.json()

        return get

    async def as_backend(path: str) -> tuple[int, Any]:
        return await b.call("GET", path)

    user2 = await as_user(2)

    async def all_credited() -> bool:  # (a grab is listed once the worker has credited it)
        return len((await user2("/api/me/packets/received?limit=200"))[1]["packets"]) == 3

    await eventually(all_credited)
    received = await walk(user2, "/api/me/packets/received", "packets", "packet_id", 200)
    assert [p["packet_id"] for p in received] == sorted(sent, reverse=True)  # newest first
    mine = await walk(await as_user(1), "/api/me/packets/sent", "packets", "packet_id", 200)
    assert [p["packet_id"] for p in mine] == sorted(sent, reverse=True)
    journal = f"/api/service/accounts/{b.id(1)}/journal"
    entries = await walk(as_backend, journal, "entries", "id", 500)
    assert [e["amount"] for e in entries] == [1_000] * 3 + [-100] * 3  # oldest first
    events = await walk(as_backend, "/api/service/events", "events", "id", 500, start=before)
    topups = [e for e in events if e["user_id"] == b.id(1) and e["type"] == "account.topup"]
    assert len(topups) == 3 and [e["id"] for e in events] == sorted(e["id"] for e in events)

    # Past the end: the oldest-first lists refuse a cursor no item had; newest first, any cursor is inside.
    for path, name, last in (
        (journal, "entries", entries[-1]["id"]),
        ("/api/service/events", "events", None),
    ):
        last = last or (await b.ok("GET", f"{path}?after={events[-1]['id']}&limit=500"))["next"]
        status, end = await as_backend(f"{path}?after={last}")
        assert (status, end[name], end["next"], end["more"]) == (200, [], last, False), end
        status, past = await as_backend(f"{path}?after={last + 1_000_000}")
        assert (status, past["error"]["code"]) == (400, "bad_request"), past
    status, oldest = await user2(f"/api/me/packets/received?after={min(sent)}")
    assert (status, oldest) == (200, {"packets": [], "next": min(sent), "more": False})
    # (Whatever Python's int() would also read is not a number: a sign, spaces, underscores, other digits.)
    for query in (
        "after=-1",
        "limit=0",
        "limit=201",
        "after=x",
        f"after={2**63}",
        "limit=%2B5",
        "limit=%205",
        "limit=5_0",
        "limit=%D9%A5",
        "after=1" + "0" * 30,
    ):
        status, bad = await user2(f"/api/me/packets/received?{query}")
        assert (status, bad["error"]["code"]) == (400, "bad_request"), query
