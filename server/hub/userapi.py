"""The HTTP API's user routes (``/api/...`` but ``/api/service/``): a user's own account, history and
groups, and a packet's view, each with the caller's token (``server.hub.httpkit.endpoint``). The demo's
conveniences (name login, demo money) are here too, off unless the hub is the demo's."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.routing import Route

from server import errors
from server.core import Core
from server.errors import Conflict, Forbidden, InvalidRequest, NotFound
from server.hub.httpkit import endpoint, id_of, json_body, keyed_body, page, page_ask, path_id
from server.hub.hub import Hub
from server.hub.tokens import make_token
from server.ids import GroupId, PacketId, UserId
from server.money import grabs, groups, ledger, queries
from server.money.grabs import grab_dict, view_dict


def _demo(core: Core, what: str, on: bool) -> None:
    """Refuse a demo convenience that is off, or that a chat backend makes meaningless (its users log in
    through it; ``Settings.check`` refuses the combination at start-up too)."""
    if not on:
        raise Forbidden(errors.DISABLED, f"{what} is disabled on this hub")
    if core.settings.backend:
        raise Forbidden(errors.DISABLED, f"{what} is off beside a chat backend")


async def login(request: Request, core: Core, _: UserId) -> dict[str, object]:
    """Dev login by name (creates the user on first use). Off unless REDPACKET_DEV_LOGIN=1 or `up`, on a
    hub listening on loopback only, and never for a user the chat backend made."""
    _demo(core, "dev login", core.settings.dev_login)
    if not request.app.state.guards.tokens.rules.hmac:
        raise Forbidden(errors.DISABLED, "dev login issues HS256 tokens; this hub takes RS256/ES256 only")
    name = (await json_body(request)).get("name")
    if not isinstance(name, str):
        raise InvalidRequest(errors.NAME_INVALID, "name is required")
    found = await ledger.user_by_name(core.db, name, with_origin=True)
    if found is None:
        try:
            user_id = await ledger.create_user(core.db, name)
        except Conflict:  # created by a concurrent login
            found = await ledger.user_by_name(core.db, name, with_origin=True)
            if found is None:
                raise Conflict(errors.NAME_TAKEN, "try again") from None
    if found is not None:
        user_id, origin = found
        if origin == "backend":
            raise Forbidden(errors.MANAGED_BY_BACKEND, "this user logs in through the chat backend")
    token = make_token(
        core.settings.secret.encode(), user_id, int(time.time()), core.settings.token_ttl_seconds
    )
    return {"user_id": user_id, "name": name.strip(), "token": token}


async def me(request: Request, core: Core, user: UserId) -> dict[str, object]:
    name = await ledger.user_name(core.db, user)
    if name is None:
        raise NotFound(errors.USER_NOT_FOUND, "no such user")
    return {
        "user_id": user,
        "name": name,
        "balance": await ledger.balance(core.db, user),
        "groups": await groups.groups_of(core.db, user),
    }


async def topup(request: Request, core: Core, user: UserId) -> dict[str, object]:
    _demo(core, "demo top-up", core.settings.demo_topup)
    body = await keyed_body(request)
    await ledger.topup(core.db, user, body.get("amount"), body.get("request_id"))
    return {"user_id": user, "balance": await ledger.balance(core.db, user)}


async def _users_may_change(core: Core, group: GroupId | None = None) -> None:
    """Group management by users: off when the chat backend manages groups (REDPACKET_USER_GROUPS), and
    never on a group the backend made."""
    if not core.settings.users_manage_groups:
        raise Forbidden(errors.DISABLED, "groups and their members are managed by the chat backend here")
    if group is not None:
        await groups.require_maker(core.db, group, backend=False)


async def create_group(request: Request, core: Core, user: UserId) -> dict[str, object]:
    await _users_may_change(core)
    body = await json_body(request)
    gid = await groups.create_group(
        core.db,
        user,
        str(body.get("name") or ""),
        bool(body.get("members_can_send")),
        per_minute=core.settings.groups_per_user_per_minute,
    )
    await core.membership.changed(gid, [user], "added")
    return {"group_id": gid}


async def list_members(request: Request, core: Core, user: UserId) -> dict[str, object]:
    gid = GroupId(path_id(request, "group_id"))
    await core.membership.require(group_id=gid, user_id=user)
    return {"group_id": gid, "members": await groups.members_of(core.db, gid)}


async def add_members(request: Request, core: Core, user: UserId) -> dict[str, object]:
    gid = GroupId(path_id(request, "group_id"))
    await _users_may_change(core, gid)
    await groups.require_admin(core.db, group_id=gid, user_id=user)
    body = await json_body(request)
    user_ids, names = body.get("user_ids", []), body.get("names", [])
    most = core.settings.max_users_per_request
    if not isinstance(user_ids, list) or not isinstance(names, list) or len(user_ids) + len(names) > most:
        raise InvalidRequest(errors.BAD_REQUEST, f"user_ids and names are lists of at most {most} together")
    ids = [UserId(id_of(u, errors.USER_NOT_FOUND, "user")) for u in user_ids]
    by_name = await ledger.users_by_name(core.db, names)
    unknown = [n for n in names if n not in by_name]
    ids += [by_name[n] for n in names if n in by_name]
    if unknown:
        # Every unknown name at once, and nobody added: the admin fixes the list and sends it again.
        raise NotFound(errors.USER_NOT_FOUND, f"no user named {', '.join(unknown)}", names=unknown)
    role = body.get("role", "member")
    added = await groups.add_members(core.db, core.membership, gid, ids, role)
    hub: Hub = request.app.state.hub
    for u in ids:
        await hub.publish(gid, "member_added", {"user": u, "role": role, "by": user})
    return {"group_id": gid, "added": added}


async def remove_member(request: Request, core: Core, user: UserId) -> dict[str, object]:
    gid = GroupId(path_id(request, "group_id"))
    target = UserId(path_id(request, "user_id"))
    await _users_may_change(core, gid)
    if target != user:  # anyone may leave; only admins remove others
        await groups.require_admin(core.db, group_id=gid, user_id=user)
    removed = await groups.remove_member(core.db, core.membership, group_id=gid, user_id=target)
    if removed:
        await request.app.state.hub.publish(gid, "member_removed", {"user": target, "by": user})
    return {"group_id": gid, "removed": removed}


async def make_admin(request: Request, core: Core, user: UserId) -> dict[str, object]:
    gid = GroupId(path_id(request, "group_id"))
    target = UserId(path_id(request, "user_id"))
    await _users_may_change(core, gid)
    await groups.require_admin(core.db, group_id=gid, user_id=user)
    await groups.set_role(core.db, core.membership, "admin", group_id=gid, user_id=target)
    await request.app.state.hub.publish(gid, "member_role", {"user": target, "role": "admin", "by": user})
    return {"group_id": gid, "user_id": target, "role": "admin"}


async def packet_detail(request: Request, core: Core, user: UserId) -> dict[str, object]:
    pid = PacketId(path_id(request, "packet_id"))
    found = await queries.packet_status(core.db, pid)
    if found is None:
        raise NotFound(errors.PACKET_NOT_FOUND, "no such packet")
    group, status = found
    try:
        view = await grabs.open_packet(core, packet_id=pid, group_id=group, user_id=user)
    except Forbidden as e:
        if e.code != errors.NOT_MEMBER:
            raise
        # To a non-member, a packet is as unknown as one that does not exist: neither it nor its group
        # is named.
        raise NotFound(errors.PACKET_NOT_FOUND, "no such packet") from e
    credited = await queries.grab_states(core.db, pid)
    listed = [{**grab_dict(g), "status": credited.get(g.user_id, "grabbed")} for g in view.grabs]
    return {**view_dict(view), "grabs": listed, "status": status}


# A page of a person's history (``/api/me/packets/sent`` and ``/received``): newest first.
HISTORY_PAGE = 50
HISTORY_MOST = 200


async def my_sent(request: Request, core: Core, user: UserId) -> dict[str, object]:
    ask = page_ask(request, default=HISTORY_PAGE, most=HISTORY_MOST)
    found = await queries.sent_page(core.db, user, before=ask.after, limit=ask.limit + 1)
    return page("packets", found, ask, cursor="packet_id")


async def my_received(request: Request, core: Core, user: UserId) -> dict[str, object]:
    ask = page_ask(request, default=HISTORY_PAGE, most=HISTORY_MOST)
    found = await queries.received_page(core.db, user, before=ask.after, limit=ask.limit + 1)
    return page("packets", found, ask, cursor="packet_id")


def routes() -> list[Route]:
    return [
        Route("/api/login", endpoint(login, public=True), methods=["POST"]),
        Route("/api/me", endpoint(me)),
        Route("/api/me/packets/sent", endpoint(my_sent)),
        Route("/api/me/packets/received", endpoint(my_received)),
        Route("/api/topup", endpoint(topup), methods=["POST"]),
        Route("/api/groups", endpoint(create_group), methods=["POST"]),
        Route("/api/groups/{group_id}/members", endpoint(list_members), methods=["GET"]),
        Route("/api/groups/{group_id}/members", endpoint(add_members), methods=["POST"]),
        Route("/api/groups/{group_id}/members/{user_id}", endpoint(remove_member), methods=["DELETE"]),
        Route("/api/groups/{group_id}/admins/{user_id}", endpoint(make_admin), methods=["POST"]),
        Route("/api/packets/{packet_id}", endpoint(packet_detail)),
    ]
