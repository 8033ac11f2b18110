"""Chat groups and their members, in the database (the source of truth). Every change ends by
invalidating the Redis cache that the grab path reads (``server.money.membership``)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, TypedDict

from server import errors
from server.errors import Conflict, Forbidden, InvalidRequest, NotFound, TooMany
from server.ids import GroupId, UserId
from server.money.ledger import check_name, now_ms
from server.money.membership import Membership
from server.store.db import Database, IntegrityError, Tx

Role = Literal["admin", "member"]


async def create_group(
    db: Database, owner_id: UserId, name: str, members_can_send: bool = False, per_minute: int | None = None
) -> GroupId:
    """A new group whose owner is its first admin. ``per_minute``: refused (``rate_limited``) if the owner
    made that many in the last minute — counted under a lock on the owner's row, so concurrent calls on
    any hub count each other."""
    name = check_name(name)

    async def work(tx: Tx) -> GroupId:
        lock = tx.dialect.for_update
        if await tx.fetchone("SELECT 1 FROM users WHERE id = %s" + lock, (owner_id,)) is None:
            raise NotFound(errors.USER_NOT_FOUND, f"user {owner_id} does not exist")
        ts = now_ms()
        if per_minute is not None:
            row = await tx.fetchone(
                "SELECT COUNT(*) FROM chat_groups WHERE owner_id = %s AND created_ms > %s",
                (owner_id, ts - 60_000),
            )
            if row is not None and int(row[0]) >= per_minute:
                raise TooMany(
                    errors.RATE_LIMITED,
                    f"at most {per_minute} new groups a minute: try again later",
                    retry_after_s=60,
                    allowance=per_minute,
                )
        await tx.execute(
            "INSERT INTO chat_groups (name, owner_id, members_can_send, created_ms) VALUES (%s, %s, %s, %s)",
            (name, owner_id, int(members_can_send), ts),
        )
        if tx.lastrowid is None:
            raise RuntimeError("the database returned no id for the new group")
        group_id = GroupId(tx.lastrowid)
        await tx.execute(
            "INSERT INTO group_members (group_id, user_id, role, joined_ms) VALUES (%s, %s, 'admin', %s)",
            (group_id, owner_id, ts),
        )
        return group_id

    return await db.run(work, idempotent=False)


async def add_members(
    db: Database, membership: Membership, group_id: GroupId, user_ids: list[UserId], role: Role = "member"
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

    added = await db.run(work, idempotent=True)
    await membership.changed(group_id, wanted, "added")
    return added


@dataclass(frozen=True)
class Replaced:
    """What ``put_group`` did: whether it applied (an older version is ignored), the stored version, and
    who was added (with their role), removed, or changed role."""

    applied: bool
    version: int
    created: bool = False
    added: dict[UserId, Role] = field(default_factory=dict)
    removed: list[UserId] = field(default_factory=list)
    roles: dict[UserId, Role] = field(default_factory=dict)


async def put_group(
    db: Database,
    membership: Membership,
    group_id: GroupId,
    name: object,
    members: dict[UserId, Role],
    members_can_send: bool,
    version: int,
) -> Replaced:
    """Create group ``group_id`` or replace its name, settings and whole membership, as the chat backend
    has it at ``version``. A version lower than the stored one changes nothing (webhooks arrive out of
    order). Concurrent calls for one group are serialised by a lock on its row; the member cache is
    dropped and every hub told once the change has committed."""
    clean = check_name(name)

    async def work(tx: Tx) -> Replaced:
        wanted = sorted(members)
        known: set[UserId] = set()
        for i in range(0, len(wanted), 500):  # a statement holds at most 65,535 placeholders
            chunk = wanted[i : i + 500]
            marks = ", ".join(["%s"] * len(chunk))
            rows = await tx.fetchall(f"SELECT id FROM users WHERE id IN ({marks})", chunk)
            known |= {UserId(int(r[0])) for r in rows}
        missing = sorted(set(wanted) - known)
        if missing:
            raise NotFound(errors.USER_NOT_FOUND, f"no user {missing[0]}", user_ids=missing)
        row = await tx.fetchone(
            "SELECT service_version FROM chat_groups WHERE id = %s" + tx.dialect.for_update, (group_id,)
        )
        if row is not None and row[0] is None:
            raise Conflict(
                errors.ID_TAKEN, f"group {group_id} was made on the hub by a user, not by the backend"
            )
        ts = now_ms()
        created = row is None
        if row is None:
            owner = next((u for u in wanted if members[u] == "admin"), 0)
            await tx.execute(
                "INSERT INTO chat_groups (id, name, owner_id, members_can_send, created_ms, service_version)"
                " VALUES (%s, %s, %s, %s, %s, %s)",
                (group_id, clean, owner, int(members_can_send), ts, version),
            )
            before: dict[UserId, Role] = {}
        else:
            stored = None if row[0] is None else int(row[0])
            if stored is not None and version < stored:
                return Replaced(applied=False, version=stored)
            await tx.execute(
                "UPDATE chat_groups SET name = %s, members_can_send = %s, service_version = %s WHERE id = %s",
                (clean, int(members_can_send), version, group_id),
            )
            rows = await tx.fetchall(
                "SELECT user_id, role FROM group_members WHERE group_id = %s", (group_id,)
            )
            before = {UserId(int(r[0])): ("admin" if r[1] == "admin" else "member") for r in rows}
        added = {u: r for u, r in members.items() if u not in before}
        removed = sorted(u for u in before if u not in members)
        roles = {u: r for u, r in members.items() if u in before and before[u] != r}
        await tx.executemany(
            "INSERT INTO group_members (group_id, user_id, role, joined_ms) VALUES (%s, %s, %s, %s)",
            [(group_id, u, r, ts) for u, r in sorted(added.items())],
        )
        await tx.executemany(
            "DELETE FROM group_members WHERE group_id = %s AND user_id = %s", [(group_id, u) for u in removed]
        )
        await tx.executemany(
            "UPDATE group_members SET role = %s WHERE group_id = %s AND user_id = %s",
            [(r, group_id, u) for u, r in sorted(roles.items())],
        )
        return Replaced(True, version, created, added, removed, roles)

    try:
        done = await db.run(work, idempotent=True)
    except IntegrityError:  # the group created by a concurrent call: now there is a row to lock
        done = await db.run(work, idempotent=True)
    if done.applied and not (done.added or done.removed or done.roles):
        # Nothing differs: perhaps a retry of a call that died between its commit and this point. Drop
        # the cache and tell every hub the whole membership, so that live sockets still match it.
        await membership.changed(group_id, sorted(members), "exactly")
    elif done.applied:
        # The removed first: their live connections stop receiving the group.
        await membership.changed(group_id, done.removed, "removed")
        await membership.changed(group_id, sorted(done.added), "added")
        if done.roles:
            await membership.changed(group_id, sorted(done.roles), "role")
    return done


async def remove_member(db: Database, membership: Membership, *, group_id: GroupId, user_id: UserId) -> bool:
    async def work(tx: Tx) -> int:
        return await tx.execute(
            "DELETE FROM group_members WHERE group_id = %s AND user_id = %s", (group_id, user_id)
        )

    removed = await db.run(work, idempotent=True)
    await membership.changed(group_id, [user_id], "removed")
    return removed > 0


async def set_role(
    db: Database, membership: Membership, role: Role, *, group_id: GroupId, user_id: UserId
) -> None:
    if role not in ("admin", "member"):
        raise InvalidRequest(errors.ROLE_INVALID, "role is admin or member")

    async def work(tx: Tx) -> int:
        if await tx.execute(
            "UPDATE group_members SET role = %s WHERE group_id = %s AND user_id = %s",
            (role, group_id, user_id),
        ):
            return 1
        # No row changed: not a member — or one already in that role (a run again after a lost COMMIT
        # answer, say: MySQL counts changed rows, not matched ones).
        member = await tx.fetchone(
            "SELECT 1 FROM group_members WHERE group_id = %s AND user_id = %s", (group_id, user_id)
        )
        return 0 if member is None else 1

    if await db.run(work, idempotent=True) == 0:
        raise Forbidden(errors.NOT_MEMBER, f"user {user_id} is not in group {group_id}")
    await membership.changed(group_id, [user_id], "role")


async def require_maker(db: Database, group_id: GroupId, backend: bool) -> None:
    """Refuse a change of a group by the side that did not make it: a group the chat backend made
    (``service_version`` set) is changed through its API only (``managed_by_backend``), and one a user
    made on the hub never through that API (``id_taken``)."""
    row = await db.fetchone("SELECT service_version FROM chat_groups WHERE id = %s", (group_id,))
    if row is None:
        raise NotFound(errors.GROUP_NOT_FOUND, f"no group {group_id}")
    made_by_backend = row[0] is not None
    if made_by_backend and not backend:
        raise Forbidden(errors.MANAGED_BY_BACKEND, "this group's members are changed by the chat backend")
    if backend and not made_by_backend:
        raise Conflict(errors.ID_TAKEN, f"group {group_id} was made on the hub by a user, not by the backend")


async def role_of(tx: Tx, *, group_id: GroupId, user_id: UserId) -> tuple[Role | None, bool]:
    """(the user's role or None, whether every member may send) — raises if the group does not exist."""
    group = await tx.fetchone("SELECT members_can_send FROM chat_groups WHERE id = %s", (group_id,))
    if group is None:
        raise NotFound(errors.GROUP_NOT_FOUND, f"group {group_id} does not exist")
    row = await tx.fetchone(
        "SELECT role FROM group_members WHERE group_id = %s AND user_id = %s", (group_id, user_id)
    )
    role: Role | None = None if row is None else ("admin" if row[0] == "admin" else "member")
    return role, bool(group[0])


async def require_admin(db: Database, *, group_id: GroupId, user_id: UserId) -> None:
    async with db.transaction() as tx:
        role, _ = await role_of(tx, group_id=group_id, user_id=user_id)
    if role is None:
        raise Forbidden(errors.NOT_MEMBER, f"user {user_id} is not a member of group {group_id}")
    if role != "admin":
        raise Forbidden(errors.NOT_ADMIN, "only group admins may do this")


class MemberCounts:
    """How many members each group has, remembered for ``ttl`` seconds (and forgotten at once when a
    membership change is heard): a reconnect storm in a 10,000-member group must not count its members
    once per connection."""

    def __init__(self, ttl: float = 2.0, limit: int = 10_000) -> None:
        self.ttl = ttl
        self.limit = limit
        self._counts: dict[GroupId, tuple[int, float]] = {}

    def get(self, group_id: GroupId) -> int | None:
        hit = self._counts.get(group_id)
        if hit is None or hit[1] < time.monotonic():
            return None
        return hit[0]

    def put(self, group_id: GroupId, count: int) -> None:
        if len(self._counts) >= self.limit:
            self._counts.clear()
        self._counts[group_id] = (count, time.monotonic() + self.ttl)

    def forget(self, group_id: GroupId) -> None:
        self._counts.pop(group_id, None)


class UserGroup(TypedDict):
    """One of a user's groups, as the welcome and ``GET /api/groups`` list it."""

    group_id: GroupId
    name: str
    role: Role
    members_can_send: bool
    members: int


# Groups counted in one statement (its IN list), when a read finds many whose count is not remembered.
COUNTED_AT_ONCE = 500


async def groups_of(db: Database, user_id: UserId, counts: MemberCounts | None = None) -> list[UserGroup]:
    """The groups a user is in, with their role and each group's settings and member count (from
    ``counts`` when it holds them)."""
    return (await groups_of_many(db, [user_id], counts))[user_id]


async def groups_of_many(
    db: Database, user_ids: Sequence[UserId], counts: MemberCounts | None = None
) -> dict[UserId, list[UserGroup]]:
    """``groups_of`` for several users in one read (and one count of the groups ``counts`` lacks): the
    welcomes of sockets opened at once (``server.hub.groupreads``). Every user asked is a key."""
    wanted = list(dict.fromkeys(user_ids))
    rows = await db.fetchall(
        "SELECT m.user_id, g.id, g.name, m.role, g.members_can_send"
        " FROM group_members m JOIN chat_groups g ON g.id = m.group_id"
        f" WHERE m.user_id IN ({', '.join(['%s'] * len(wanted))}) ORDER BY m.user_id, g.id",
        tuple(wanted),
    )
    members: dict[GroupId, int | None] = {}
    for r in rows:
        g = GroupId(int(r[1]))
        if g not in members:
            members[g] = counts.get(g) if counts else None
    missing = [g for g, n in members.items() if n is None]
    for at in range(0, len(missing), COUNTED_AT_ONCE):
        some = missing[at : at + COUNTED_AT_ONCE]
        found = await db.fetchall(
            "SELECT group_id, COUNT(*) FROM group_members WHERE group_id IN"
            f" ({', '.join(['%s'] * len(some))}) GROUP BY group_id",
            tuple(some),
        )
        for g, n in found:
            members[GroupId(int(g))] = int(n)
            if counts is not None:
                counts.put(GroupId(int(g)), int(n))
    mine: dict[UserId, list[UserGroup]] = {u: [] for u in wanted}
    for r in rows:
        g = GroupId(int(r[1]))
        mine[UserId(int(r[0]))].append(
            UserGroup(
                group_id=g,
                name=str(r[2]),
                role="admin" if r[3] == "admin" else "member",
                members_can_send=bool(r[4]),
                members=members.get(g) or 0,
            )
        )
    return mine


async def members_of(db: Database, group_id: GroupId) -> list[dict[str, object]]:
    """A group's members with their names and roles, admins first."""
    rows = await db.fetchall(
        "SELECT u.id, u.name, m.role FROM group_members m JOIN users u ON u.id = m.user_id"
        " WHERE m.group_id = %s ORDER BY m.role = 'admin' DESC, u.name",
        (group_id,),
    )
    return [{"user_id": int(r[0]), "name": r[1], "role": r[2]} for r in rows]
