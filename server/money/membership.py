"""Who is in which group, as the grab path sees it: a Redis cache of the database's member lists.

The cache of a group is complete only while it holds ``keys.LOADED``. A change commits to the database,
then ``changed`` bumps the group's membership version and drops the cache. A reload reads the version,
then the database, then writes the cache only if the version has not moved (``fill_members.lua``), so a
reload racing a removal can never put the removed member back. Within one process concurrent misses of
one group share a single reload.
"""

from __future__ import annotations

import asyncio
from typing import Literal

import msgpack
from redis.asyncio import Redis

from server import errors
from server.errors import Forbidden
from server.ids import GroupId, UserId
from server.store import keys
from server.store.batch import Batcher
from server.store.db import Database
from server.store.scriptcalls import FillMembersCall, run_alone
from server.store.scripts import Scripts

# "exactly": the users are the group's whole membership (hubs drop or add their sockets to match).
Change = Literal["added", "removed", "role", "exactly"]


def parse_change(note: bytes) -> tuple[GroupId, list[UserId], Change]:
    body = msgpack.unpackb(note, raw=False)
    return GroupId(int(body["group"])), [UserId(int(u)) for u in body["users"]], body["change"]


def not_member(*, group_id: GroupId, user_id: UserId) -> Forbidden:
    return Forbidden(errors.NOT_MEMBER, f"user {user_id} is not a member of group {group_id}")


class Membership:
    def __init__(
        self, db: Database, redis: Redis, scripts: Scripts, cache_seconds: int, batcher: Batcher
    ) -> None:
        self._db = db
        self._redis = redis
        self._scripts = scripts
        self._cache_seconds = cache_seconds
        self._batcher = batcher
        self._loading: dict[GroupId, asyncio.Task[frozenset[UserId]]] = {}

    async def is_member(self, *, group_id: GroupId, user_id: UserId) -> bool:
        """One Redis round trip when the cache is warm; a database read when it is not."""
        key = keys.group_members(group_id)
        wanted = [keys.LOADED, str(user_id)]
        loaded, member = await self._batcher.call(lambda pipe: pipe.smismember(key, wanted), key)
        if loaded:
            return bool(member)
        return user_id in await self._load(group_id)

    async def require(self, *, group_id: GroupId, user_id: UserId) -> None:
        if not await self.is_member(group_id=group_id, user_id=user_id):
            raise not_member(group_id=group_id, user_id=user_id)

    async def changed(self, group_id: GroupId, user_ids: list[UserId], change: Change) -> None:
        """Call after a membership change has committed: drops the cache, and tells every hub, so that a
        removed member's live connections stop receiving the group at once."""
        note = msgpack.packb({"group": group_id, "users": user_ids, "change": change})
        # The version goes up after the database committed the change: a reload that read the database
        # before the change sees a new version when it comes to fill the cache, and fills nothing.
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.incr(keys.group_members_version(group_id))
            pipe.delete(keys.group_members(group_id))
            await pipe.execute()
        # (The cluster client has no spublish(); the command is routed by its channel's slot.)
        # (redis-py's execute_command is not annotated.)
        await self._redis.execute_command("SPUBLISH", keys.membership_channel(), note)  # type: ignore[no-untyped-call]

    async def _load(self, group_id: GroupId) -> frozenset[UserId]:
        # The load runs as its own task: a cancelled caller does not cancel it for the others waiting.
        task = self._loading.get(group_id)
        if task is None:
            task = asyncio.create_task(self._read_and_fill(group_id))
            self._loading[group_id] = task
            task.add_done_callback(lambda _: self._loading.pop(group_id, None))
        return await asyncio.shield(task)

    async def _read_and_fill(self, group_id: GroupId) -> frozenset[UserId]:
        version: bytes | None = await self._redis.get(keys.group_members_version(group_id))
        rows = await self._db.fetchall("SELECT user_id FROM group_members WHERE group_id = %s", (group_id,))
        members = frozenset(UserId(int(r[0])) for r in rows)
        fill = FillMembersCall(
            group_id=group_id, version=version or b"", ttl_seconds=self._cache_seconds, members=members
        )
        await run_alone(self._scripts, fill)
        return members
