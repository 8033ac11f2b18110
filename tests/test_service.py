"""The chat backend's API (/api/service/*) on a real hub: users, whole groups by version, single member
changes, funding paid once per request id, account reads, and what live sockets see of each change."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from redpacket_client.connection import HubClient, HubError
from server.core import open_core
from server.money import ledger
from server.money.reconcile import reconcile
from server.settings import Settings
from server.store.engines import connect
from tests.chatbackend import KEY, Backend
from tests.hubtools import HubUnderTest, events_of, hub_in_process


async def notice(c: HubClient) -> dict[str, Any]:
    """The next notice (removed, added) on a socket, past its welcome."""
    while (n := await c.next_notice())["type"] == "welcome":
        pass
    return n


async def test_refused_without_the_key_with_a_user_token_and_when_off(
    service_hub: HubUnderTest, hub_settings: Settings
) -> None:
    b = Backend(service_hub)
    await b.ok("PUT", f"/api/service/users/{b.id(1)}", name=f"u{b.id(1)}")
    for key in ["", "wrong", b.token(1)]:
        status, data = await b.call("PUT", f"/api/service/users/{b.id(2)}", key=key, name="x")
        assert (status, data["error"]["code"]) == (401, "token_invalid"), key
    # The service key is no user's token either.
    assert (await service_hub.api("GET", "/api/me", KEY))["error"]["code"] == "token_invalid"
    async with hub_in_process(hub_settings) as off:
        status, data = await Backend(off).call(
            "POST", "/api/service/topup", user_id=1, amount=1, request_id="r"
        )
        assert (status, data["error"]["code"]) == (403, "disabled")


async def test_users_are_put_by_id_replays_change_nothing_and_names_stay_unique(
    service_hub: HubUnderTest,
) -> None:
    b = Backend(service_hub)
    path = f"/api/service/users/{b.id(1)}"
    assert (await b.ok("PUT", path, name=f"wang{b.base}"))["result"] == "created"
    assert (await b.ok("PUT", path, name=f"wang{b.base}"))["result"] == "unchanged"
    assert (await b.ok("PUT", path, name=f"Wang Wei {b.base}"))["result"] == "renamed"
    # The user the backend made logs in with the backend's token.
    me = await service_hub.api("GET", "/api/me", b.token(1))
    assert (me["user_id"], me["name"], me["balance"]) == (b.id(1), f"Wang Wei {b.base}", 0)
    await b.ok("PUT", f"/api/service/users/{b.id(2)}", name=f"li{b.base}")
    status, data = await b.call("PUT", path, name=f"li{b.base}")
    assert (status, data["error"]["code"]) == (409, "name_taken")
    status, data = await b.call("PUT", path, name="\u202eevil")
    assert (status, data["error"]["code"]) == (400, "name_invalid")
    # Concurrent first puts of one user: one creates it, the others find it.
    results = await asyncio.gather(
        *(b.ok("PUT", f"/api/service/users/{b.id(3)}", name=f"zhao{b.base}") for _ in range(8))
    )
    assert sorted(r["result"] for r in results) == ["created"] + ["unchanged"] * 7


async def test_a_group_put_whole_by_version_reaches_live_sockets_and_an_older_version_is_ignored(
    service_hub: HubUnderTest,
) -> None:
    b = Backend(service_hub)
    for n in (1, 2, 3):
        await b.ok("PUT", f"/api/service/users/{b.id(n)}", name=f"p{n}-{b.base}")
    group = b.id(100)
    path = f"/api/service/groups/{group}"
    missing = await b.call("PUT", path, name="family", members=[b.id(1), b.id(9)], version=1)
    assert missing[0] == 404 and missing[1]["error"]["code"] == "user_not_found"
    assert missing[1]["error"]["user_ids"] == [b.id(9)]

    first = await b.ok("PUT", path, name="family", members=[b.id(2), b.id(3)], admins=[b.id(1)], version=5)
    assert (first["applied"], first["created"], first["added"]) == (True, True, [b.id(1), b.id(2), b.id(3)])
    admin = await HubClient.connect(service_hub.ws, b.token(1))
    member = await HubClient.connect(service_hub.ws, b.token(3))
    await admin.sync()
    await member.sync()
    assert admin.groups == [group] and member.groups == [group]
    assert (await b.ok("PUT", path, name="family", members=[b.id(2), b.id(3)], admins=[b.id(1)], version=5))[
        "added"
    ] == []  # a replay: nothing changes, nothing is announced

    # Version 7 removes member 3: his live socket is told at once and his requests are refused.
    seven = await b.ok("PUT", path, name="family", members=[b.id(2)], admins=[b.id(1)], version=7)
    assert seven["removed"] == [b.id(3)]
    assert await notice(member) == {"type": "removed", "group": group}
    with pytest.raises(HubError) as refused:
        await member.request("chat", group=group, text="still here?")
    assert refused.value.code == "not_member"

    # Version 6 arrives late (it still had member 3): ignored.
    late = await b.ok("PUT", path, name="family", members=[b.id(2), b.id(3)], admins=[b.id(1)], version=6)
    assert (late["applied"], late["version"]) == (False, 7)
    listed = await service_hub.api("GET", f"/api/groups/{group}/members", b.token(1))
    assert sorted(m["user_id"] for m in listed["members"]) == [b.id(1), b.id(2)]

    # A packet sent by the admin is grabbed by the members the backend put there, and no one else.
    await b.ok("POST", "/api/service/topup", user_id=b.id(1), amount=1_000, request_id=f"fund-{b.base}")
    sent = await admin.request("send", group=group, total=500, count=1)
    two = await HubClient.connect(service_hub.ws, b.token(2))
    assert (await two.request("grab", group=group, packet=sent["packet_id"]))["amount"] == 500
    with pytest.raises(HubError) as outsider:
        await member.request("grab", group=group, packet=sent["packet_id"])
    assert outsider.value.code == "not_member"

    # A put that died between its commit and telling the hubs (the database changed, nobody told): its
    # retry finds nothing to change, and still brings the live sockets in line with the membership.
    db = await connect(service_hub.settings.database_url)
    try:
        async with db.transaction() as tx:
            await tx.execute(
                "DELETE FROM group_members WHERE group_id = %s AND user_id = %s", (group, b.id(2))
            )
            await tx.execute("UPDATE chat_groups SET service_version = 8 WHERE id = %s", (group,))
    finally:
        await db.close()
    retry = await b.ok("PUT", path, name="family", members=[], admins=[b.id(1)], version=8)
    assert (retry["applied"], retry["removed"]) == (True, [])
    assert await notice(two) == {"type": "removed", "group": group}
    with pytest.raises(HubError) as cut_off:
        await two.request("chat", group=group, text="am I still in?")
    assert cut_off.value.code == "not_member"

    # Single changes: member 3 back in as an admin (the socket hears it), then out; replays are no-ops.
    members = f"{path}/members"
    assert (await b.ok("POST", members, user_id=b.id(3), role="admin"))["role"] == "admin"
    assert await notice(member) == {"type": "added", "group": group}
    await b.ok("POST", members, user_id=b.id(3), role="admin")
    assert (await b.ok("DELETE", f"{members}/{b.id(3)}"))["removed"] is True
    assert (await b.ok("DELETE", f"{members}/{b.id(3)}"))["removed"] is False
    assert await notice(member) == {"type": "removed", "group": group}
    for c in (admin, member, two):
        await c.close()


async def test_a_service_top_up_is_paid_once_under_concurrent_retries_and_reconciles(
    service_hub: HubUnderTest,
) -> None:
    b = Backend(service_hub)
    await b.ok("PUT", f"/api/service/users/{b.id(1)}", name=f"payee{b.base}")
    request_id = f"wallet-{b.base}"
    answers = await asyncio.gather(
        *(
            b.ok("POST", "/api/service/topup", user_id=b.id(1), amount=8_800, request_id=request_id)
            for _ in range(20)
        )
    )
    assert sorted(a["replay"] for a in answers) == [False] + [True] * 19
    assert all(a["balance"] == 8_800 for a in answers if a["replay"])
    # The same request id for another amount or user is a mistake, said as such; nothing moves.
    for body in ({"user_id": b.id(1), "amount": 1}, {"user_id": b.id(1), "amount": 8_801}):
        status, data = await b.call("POST", "/api/service/topup", request_id=request_id, **body)
        assert (status, data["error"]["code"]) == (409, "idempotency_key_reused")
    for bad, code in [
        ({"amount": 0}, "amount_invalid"),
        ({"amount": 1.5}, "bad_request"),  # (not a JSON integer: said so, before any amount rule)
        ({"request_id": ""}, "bad_request"),
    ]:
        status, data = await b.call(
            "POST", "/api/service/topup", **{"user_id": b.id(1), "amount": 5, "request_id": "x", **bad}
        )
        assert (status, data["error"]["code"]) == (400, code)
    status, data = await b.call(
        "POST", "/api/service/topup", user_id=b.id(2), amount=5, request_id=f"n{b.base}"
    )
    assert (status, data["error"]["code"]) == (404, "user_not_found")

    account = await b.ok("GET", f"/api/service/accounts/{b.id(1)}")
    assert account == {"user_id": b.id(1), "balance": 8_800, "journal_sum": 8_800}
    page = await b.ok("GET", f"/api/service/accounts/{b.id(1)}/journal?after=0&limit=10")
    assert [(e["amount"], e["kind"], e["key"]) for e in page["entries"]] == [
        (8_800, "topup", f"service-topup:{request_id}")
    ]
    assert page["next"] == page["entries"][-1]["id"] and page["more"] is False
    # Demo top-ups stay demo-only: this hub has them off.
    demo = await service_hub.api("POST", "/api/topup", b.token(1), amount=100, request_id="demo")
    assert demo["error"]["code"] == "disabled"

    async with open_core(service_hub.settings) as core:
        assert (await reconcile(core)).ok


async def test_a_big_group_is_put_in_one_call(service_hub: HubUnderTest) -> None:
    """More members than a statement's placeholders could hold if they were listed in one IN (...)."""
    b = Backend(service_hub)
    db = await connect(service_hub.settings.database_url)
    try:
        people = await ledger.create_users(db, [f"big{b.base}-{i}" for i in range(1_500)])
    finally:
        await db.close()
    path = f"/api/service/groups/{b.id(7)}"
    put = await b.ok("PUT", path, name="everyone", members=people[1:], admins=people[:1], version=1)
    assert len(put["added"]) == 1_500
    trimmed = await b.ok("PUT", path, name="everyone", members=people[1:1_000], admins=people[:1], version=2)
    assert trimmed["removed"] == sorted(people[1_000:])


async def test_the_backend_sends_for_a_user_and_from_its_own_account_paid_once_and_seen_live(
    service_hub: HubUnderTest,
) -> None:
    b = Backend(service_hub)
    for n, name in ((1, "admin"), (2, "member"), (9, "promotions")):
        await b.ok("PUT", f"/api/service/users/{b.id(n)}", name=f"{name}{b.base}")
    group = b.id(100)
    members = dict(members=[b.id(2)], admins=[b.id(1)], version=1)
    await b.ok("PUT", f"/api/service/groups/{group}", name="g", **members)
    for n in (1, 9):  # the admin's money, and the promotions account the backend funds
        fund = f"fund-{b.base}-{n}"
        await b.ok("POST", "/api/service/topup", user_id=b.id(n), amount=5_000, request_id=fund)
    member = await HubClient.connect(service_hub.ws, b.token(2))
    await member.sync()
    try:
        # For a user (who may send here), retried at once by a backend that lost the answer: paid once.
        body = dict(sender_id=b.id(1), group_id=group, total=300, count=2, greeting="恭喜", request_id="p1")
        answers = await asyncio.gather(*(b.ok("POST", "/api/service/packets", **body) for _ in range(5)))
        assert sorted(a["replay"] for a in answers) == [False] + [True] * 4
        assert len({a["packet_id"] for a in answers}) == 1 and answers[0]["group_id"] == group
        # From the backend's own account, no member of the group: a promotion.
        promo = await b.ok(
            "POST", "/api/service/packets", sender_id=b.id(9), group_id=group, total=200, count=1,
            request_id="spring", system=True,
        )  # fmt: skip
        # Members online see both arrive, as any send.
        seen = await events_of(member, 2, "packet")
        assert {e["data"]["packet_id"] for e in seen} == {answers[0]["packet_id"], promo["packet_id"]}
        assert {e["data"]["sender"] for e in seen} == {b.id(1), b.id(9)}
        won = await member.request("grab", group=group, packet=promo["packet_id"])
        assert (won["outcome"], won["amount"]) == ("won", 200)

        # The rules of a send stand: the member may not send here, the account is not in the group
        # without `system`, no money, an unknown sender; nothing of these moves money.
        for fields, status, code in [
            ({"sender_id": b.id(2)}, 403, "not_admin"),
            ({"sender_id": b.id(9)}, 403, "not_member"),
            ({"sender_id": b.id(9), "system": True, "total": 20_000, "count": 1}, 409, "insufficient_funds"),
            ({"sender_id": b.id(7), "system": True}, 404, "user_not_found"),
            ({"sender_id": b.id(1), "request_id": None}, 400, "bad_request"),
            ({"sender_id": b.id(1), "system": "yes"}, 400, "bad_request"),
        ]:
            sent = {"group_id": group, "total": 100, "count": 1, "request_id": f"r-{code}", **fields}
            given = {k: v for k, v in sent.items() if v is not None}
            got = await b.call("POST", "/api/service/packets", **given)
            assert (got[0], got[1]["error"]["code"]) == (status, code), fields
        balances = [(await b.ok("GET", f"/api/service/accounts/{b.id(n)}"))["balance"] for n in (1, 9)]
        assert balances == [5_000 - 300, 5_000 - 200]
    finally:
        await member.close()
    async with open_core(service_hub.settings) as core:
        assert (await reconcile(core)).ok
