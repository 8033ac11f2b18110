"""The welcomes' reads of their users' groups, coalesced (``server.hub.groupreads``): sockets that open
while a read is on its way share the next one, each still welcomed with its own groups; a read that fails
fails its sockets only."""

from __future__ import annotations

import asyncio

import pytest
from websockets.exceptions import ConnectionClosed

from redpacket_client.connection import HubClient
from server.hub import groupreads
from server.settings import Settings
from tests.books import locked_tables
from tests.hubtools import HubUnderTest, eventually, hub_in_process, make_room


async def test_sockets_opened_while_a_read_waits_share_the_next_one(h: HubUnderTest) -> None:
    rooms = [await make_room(h, 4, prefix=f"r{i}-") for i in range(3)]
    people = [(room.group, token) for room in rooms for _, token in room.members]
    reads = h.hub.group_reads
    asked, made = reads.asked, reads.reads
    opening: list[asyncio.Task[HubClient]] = []
    # Another session holds the member tables: the first reads wait on them. The sockets open one after
    # another (each asks before the next opens), so that without coalescing each would make its own read.
    with locked_tables(h.settings.database_url, "group_members", "chat_groups"):
        for _, token in people:
            opening.append(asyncio.create_task(HubClient.connect(h.ws, token)))
            await eventually(lambda: reads.asked - asked == len(opening), timeout=30)
        assert reads.flying == groupreads.AT_ONCE  # the state under test: reads held, sockets waiting
    clients = await asyncio.gather(*opening)
    try:
        # Twelve sockets: the reads on their way when the lock went, and one for all the rest.
        assert reads.reads - made == groupreads.AT_ONCE + 1, reads.reads - made
        for (group, _), c in zip(people, clients, strict=True):
            assert [g["group_id"] for g in c.welcome["groups"]] == [group]  # its own, not a neighbour's
            assert c.welcome["groups"][0]["members"] == 5  # the admin and four members
    finally:
        await asyncio.gather(*(c.close() for c in clients))


async def test_a_read_that_fails_refuses_its_sockets_and_the_next_one_reads_again(
    hub_settings: Settings,
) -> None:
    settings = hub_settings.replace(db_statement_timeout_ms=500)  # (shorter than the welcome's bound)
    async with hub_in_process(settings) as h:
        room = await make_room(h, 2)
        reads = h.hub.group_reads
        with locked_tables(h.settings.database_url, "group_members", "chat_groups"):
            refused = asyncio.create_task(HubClient.connect(h.ws, room.members[0][1]))
            done, _ = await asyncio.wait({refused}, timeout=30)
            assert done and refused.exception() is not None
            closed = refused.exception().rcvd  # type: ignore[union-attr]
            assert (closed.code, closed.reason) == (1013, "database_unavailable")
            await eventually(lambda: reads.flying == 0, timeout=30)  # over, while the tables are still held
        c = await HubClient.connect(h.ws, room.members[1][1])
        try:
            assert [g["group_id"] for g in c.welcome["groups"]] == [room.group]
        finally:
            await c.close()


async def test_sockets_given_up_on_are_not_read_for(hub_settings: Settings) -> None:
    """Welcomes that run out while the reads are held leave nothing queued: once the database answers,
    no read is spent on sockets that are gone."""
    async with hub_in_process(hub_settings.replace(handshake_seconds=1.0)) as h:
        room = await make_room(h, 4)
        reads = h.hub.group_reads
        asked = reads.asked
        with locked_tables(h.settings.database_url, "group_members", "chat_groups"):
            opening = []
            for _, token in room.members:
                opening.append(asyncio.create_task(HubClient.connect(h.ws, token)))
                await eventually(lambda: reads.asked - asked == len(opening), timeout=30)
            assert reads.flying == groupreads.AT_ONCE and reads.waiting == 2  # two wait behind the reads
            for refused in asyncio.as_completed(opening, timeout=30):
                with pytest.raises(ConnectionClosed) as e:
                    await refused
                assert e.value.rcvd is not None and e.value.rcvd.code == 1013
            assert reads.waiting == 0  # given up on: out of the queue while the tables are still held


async def test_a_stopping_hub_refuses_the_sockets_waiting_for_a_read(h: HubUnderTest) -> None:
    room = await make_room(h, 4)
    reads = h.hub.group_reads
    asked = reads.asked
    with locked_tables(h.settings.database_url, "group_members", "chat_groups"):
        opening = []
        for _, token in room.members[:3]:
            opening.append(asyncio.create_task(HubClient.connect(h.ws, token)))
            await eventually(lambda: reads.asked - asked == len(opening), timeout=30)
        assert reads.waiting == 1  # the third, behind the two reads held
        reads.close()  # (as the hub's stop does first)
        for refused in (opening[2], asyncio.create_task(HubClient.connect(h.ws, room.members[3][1]))):
            with pytest.raises(ConnectionClosed) as e:
                await asyncio.wait_for(refused, 30)
            assert e.value.rcvd is not None
            assert (e.value.rcvd.code, e.value.rcvd.reason) == (1013, "database_unavailable")
    for c in await asyncio.gather(*opening[:2]):  # the reads on their way still answer theirs
        await c.close()
    await eventually(lambda: reads.flying == 0, timeout=30)
