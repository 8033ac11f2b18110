"""Chat groups and their members. MySQL is the source of truth; Redis holds a cache of each group's
member set that the grab path reads.

The cache is complete only while it holds ``keys.LOADED``. A change commits to the database, bumps the
group's membership version and drops the cache; a reload writes the cache only if the version did not
move meanwhile (WATCH), so a reload racing a removal can never put the removed member back.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Literal, cast

from redis.asyncio import Redis
from redis.exceptions import WatchError

from server import errors, keys
from server.db import Database, Tx
from server.errors import Forbidden, InvalidRequest, NotFound
from server.ledger import now_ms

Role = Literal["admin", "member"]


async def create_group(db: Database, owner_id: int, name: str, members_can_send: bool = False) -> int:
    """A new group whose owner is its first admin."""
    if not isinstance(name, str) or not name.strip() or len(name.strip()) > 64:
        raise InvalidRequest(errors.NAME_INVALID, "a group name is 1 to 64 characters")

    async def work(tx: Tx) -> int:
        if await tx.fetchone("SELECT 1 FROM users WHERE id = %s", (owner_id,)) is None:
            raise NotFound(errors.USER_NOT_FOUND, f"user {owner_id} does not exist")
        ts = now_ms()
        await tx.execute(
            "INSERT INTO chat_groups (name, owner_id, members_can_send, created_ms) VALUES (%s, %s, %s, %s)",
            (name.strip(), owner_id, int(members_can_send), ts),
        )
        group_id = tx.lastrowid
        if group_id is None:
            raise RuntimeError("the database returned no id for the new group")
        await tx.execute(
            "INSERT INTO group_members (group_id, user_id, role, joined_ms) VALUES (%s, %s, 'admin', %s)",
            (group_id, owner_id, ts),
        )
        return group_id

    return await db.run(work)


async def invalidate(redis: Redis, group_id: int) -> None:
    """Drop the cached member set after a change has committed."""
    async with redis.pipeline(transaction=True) as pipe:
        pipe.incr(keys.group_members_version(group_id))
        pipe.delete(keys.group_members(group_id))
        await pipe.execute()


async def add_members(
    db: Database, redis: Redis, group_id: int, user_ids: list[int], role: Role = "member"
) -> int:
    """Add users to a group (already-members keep their role); return how many were new."""
    if role not in ("admin", "member"):
        raise InvalidRequest(errors.ROLE_INVALID, "role is admin or member")

    wanted = sorted(set(user_ids))

    async def work(tx: Tx) -> int:
        if await tx.fetchone("SELECT 1 FROM chat_groups WHERE id = %s", (group_id,)) is None:
            raise NotFound(errors.GROUP_NOT_FOUND, f"group {group_id} does not exist")
        if not wanted:
            return 0
        marks = ", ".join(["%s"] * len(wanted))
        known = {int(r[0]) for r in await tx.fetchall(f"SELECT id FROM users WHERE id IN ({marks})", wanted)}
        if len(known) != len(wanted):
            missing = min(set(wanted) - known)
            raise NotFound(errors.USER_NOT_FOUND, f"user {missing} does not exist")
        present = {
            int(r[0])
            for r in await tx.fetchall(
                f"SELECT user_id FROM group_members WHERE group_id = %s AND user_id IN ({marks})",
                [group_id, *wanted],
            )
        }
        ts = now_ms()
        new = [(group_id, u, role, ts) for u in wanted if u not in present]
        await tx.executemany(
            "INSERT INTO group_members (group_id, user_id, role, joined_ms) VALUES (%s, %s, %s, %s)", new
        )
        return len(new)

    added = await db.run(work)
    await invalidate(redis, group_id)
    return added


async def remove_member(db: Database, redis: Redis, group_id: int, user_id: int) -> bool:
    async def work(tx: Tx) -> int:
        return await tx.execute(
            "DELETE FROM group_members WHERE group_id = %s AND user_id = %s", (group_id, user_id)
        )

    removed = await db.run(work)
    await invalidate(redis, group_id)
    return removed > 0


async def set_role(db: Database, redis: Redis, group_id: int, user_id: int, role: Role) -> None:
    if role not in ("admin", "member"):
        raise InvalidRequest(errors.ROLE_INVALID, "role is admin or member")

    async def work(tx: Tx) -> int:
        return await tx.execute(
            "UPDATE group_members SET role = %s WHERE group_id = %s AND user_id = %s",
            (role, group_id, user_id),
        )

    if await db.run(work) == 0:
        raise Forbidden(errors.NOT_MEMBER, f"user {user_id} is not in group {group_id}")
    await invalidate(redis, group_id)


async def role_of(tx: Tx, group_id: int, user_id: int) -> tuple[Role | None, bool]:
    """(the user's role or None, whether every member may send) — raises if the group does not exist."""
    group = await tx.fetchone("SELECT members_can_send FROM chat_groups WHERE id = %s", (group_id,))
    if group is None:
        raise NotFound(errors.GROUP_NOT_FOUND, f"group {group_id} does not exist")
    row = await tx.fetchone(
        "SELECT role FROM group_members WHERE group_id = %s AND user_id = %s", (group_id, user_id)
    )
    role: Role | None = None if row is None else ("admin" if row[0] == "admin" else "member")
    return role, bool(group[0])


async def member_ids(db: Database, group_id: int) -> list[int]:
    rows = await db.fetchall("SELECT user_id FROM group_members WHERE group_id = %s", (group_id,))
    return [int(r[0]) for r in rows]


async def is_member(db: Database, redis: Redis, group_id: int, user_id: int, cache_seconds: int) -> bool:
    """Whether ``user_id`` is in ``group_id``: one Redis round trip when the cache is warm."""
    key = keys.group_members(group_id)
    loaded, member = await cast(Awaitable[list[int]], redis.smismember(key, [keys.LOADED, str(user_id)]))
    if loaded:
        return bool(member)
    version_key = keys.group_members_version(group_id)
    async with redis.pipeline(transaction=True) as pipe:
        await pipe.watch(version_key)
        members = await member_ids(db, group_id)
        pipe.multi()  # type: ignore[no-untyped-call]
        pipe.delete(key)
        pipe.sadd(key, keys.LOADED, *[str(m) for m in members])
        pipe.expire(key, cache_seconds)
        try:
            await pipe.execute()
        except WatchError:
            pass  # membership changed while we read it: answer from the database, cache nothing
    return user_id in members


async def require_member(db: Database, redis: Redis, group_id: int, user_id: int, cache_seconds: int) -> None:
    if not await is_member(db, redis, group_id, user_id, cache_seconds):
        raise Forbidden(errors.NOT_MEMBER, f"user {user_id} is not a member of group {group_id}")
