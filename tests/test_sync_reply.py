"""A sync's reply against the events sent before it (docs/protocol.md, "Recovery"), with a real hub and
real websocket clients: a client that keeps the reply's offset never gets an event twice."""

from __future__ import annotations

from typing import Any

import pytest

from redpacket_client.connection import HubClient
from redpacket_client.protocol import offset_key
from server.ids import GroupId, UserId
from server.live import events
from server.live.events import Missed
from server.money import groups
from tests.hubtools import HubUnderTest, eventually
from tests.repofiles import says


def _received(c: HubClient) -> list[dict[str, Any]]:
    """The events this client has received and not yet looked at."""
    out = []
    while not c.events.empty():
        out.append(c.events.get_nowait())
    return out


def _reached(h: HubUnderTest, user: UserId, group: GroupId, offset: str) -> bool:
    """The event at ``offset`` has reached the user's socket on the hub: held there, or sent."""
    key = offset_key(offset)
    return any(
        key in c.holding(group) or c.last.get(group, (0, 0)) >= key for c in h.hub.by_user.get(user, ())
    )


@pytest.mark.parametrize("read_when", ["its own group was read", "a later group was read"])
async def test_the_reply_accounts_for_every_event_sent_before_it(
    h: HubUnderTest, monkeypatch: pytest.MonkeyPatch, read_when: str
) -> None:
    """Before: an event that came while the sync ran (held after its group was read, or sent live while
    a later group was read) went out before the reply, uncounted in `replayed` and newer than the reply's
    `offset`: a client keeping that offset got it again on its next sync."""
    says(
        "`n` counts them: those the group's stream held and those that happened while the hub answered the"
        " sync."
    )
    says("so a client that keeps `o` as the last offset it saw never gets one of them again.")
    admin, admin_token = await h.login("wang")
    member, member_token = await h.login("li")
    first = await groups.create_group(h.core.db, admin, "family")
    second = await groups.create_group(h.core.db, admin, "work")
    for g in (first, second):
        await groups.add_members(h.core.db, h.core.membership, g, [member])
    wang = await h.client(admin_token)
    start = {g: (await wang.request("chat", group=g, text="seen"))["offset"] for g in (first, second)}
    for g in (first, second):
        for i in range(3):
            await wang.request("chat", group=g, text=f"missed {i}")

    # The sync is held at the moment the race needs: right after it read the stream of `first` (or of
    # `second`, `first` being done), a chat comes in `first` and reaches the member's socket.
    real_since = events.since
    late: list[str] = []

    async def since_then_a_chat(core: Any, group_id: GroupId, offset: str, limit: int) -> Missed:
        missed = await real_since(core, group_id, offset, limit)
        if group_id == (first if read_when == "its own group was read" else second) and not late:
            late.append((await wang.request("chat", group=first, text="during the sync"))["offset"])
            await eventually(lambda: _reached(h, member, first, late[0]), timeout=10)
        return missed

    monkeypatch.setattr(events, "since", since_then_a_chat)
    back = await h.client(member_token, sync=False)
    reply = (await back.request("sync", groups={str(g): start[g] for g in (first, second)}))["groups"]
    got = _received(back)  # the reply came after them: all are here
    # The dangerous state: an event that happened after the sync began was delivered before its reply.
    assert [e["offset"] for e in got if e["data"].get("text") == "during the sync"] == late
    for g in (first, second):
        sent = [e for e in got if e["group"] == g]
        chats = [e["data"]["text"] for e in sent if e["event"] == "chat"]
        assert chats[:3] == [f"missed {i}" for i in range(3)]
        assert reply[str(g)]["replayed"] == len(sent)
        assert all(offset_key(e["offset"]) <= offset_key(reply[str(g)]["offset"]) for e in sent)
    await back.close()

    # Back again from the reply's offsets: nothing sent before that reply comes a second time.
    again = await h.client(member_token, sync=False)
    await again.request("sync", groups={str(g): reply[str(g)]["offset"] for g in (first, second)})
    twice = {(e["group"], e["offset"]) for e in _received(again)} & {(e["group"], e["offset"]) for e in got}
    assert not twice
    for c in (again, wang):
        await c.close()
