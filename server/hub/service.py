"""The chat backend's API (``/api/service/*``): the app that owns users, groups and wallets keeps the hub's
view of them in step, and funds accounts from its own wallet.

Authenticated by ``Authorization: Bearer $REDPACKET_SERVICE_KEY``, never by a user's token (``routes()``
puts every handler behind the key), and off when the key is unset. Every call is idempotent: a user or a
group is put whole; a group's membership carries the backend's ``version`` and an older one is ignored; a
top-up is paid once per ``request_id``. Membership changes reach live sockets at once (a removed member
stops receiving the group), and each is announced in the group as the user routes announce theirs, with
``by: 0`` (the backend).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from server import errors
from server.core import Core
from server.errors import Forbidden, InvalidRequest, NotFound
from server.hub import requests, webhookapi
from server.hub.guards import Guards, refuse_wrong_key
from server.hub.httpkit import (
    Handler,
    bearer,
    endpoint,
    id_of,
    json_body,
    keyed_body,
    page,
    page_ask,
    path_id,
)
from server.hub.hub import Hub
from server.ids import GroupId, UserId
from server.money import events, groups, ledger, payouts, queries
from server.money.groups import Role
from server.money.journal import journal_page, journal_sum
from server.signing import same_secret

BY_BACKEND = 0  # the `by` of an event caused through this API
MAX_MEMBERS = 100_000
JOURNAL_PAGE = 500
EVENTS_PAGE = 100


def _require_key(request: Request, core: Core) -> None:
    """The service key, compared in constant time. The right key is always taken: wrong ones from the
    backend's own address (a proxy, a NAT) must not lock the backend out. Wrong keys are counted (a metric
    to alert on), and an address past ``REDPACKET_SERVICE_KEY_FAILURES_PER_MINUTE`` of them is answered
    429 instead of 401 until its allowance refills (a key of 32+ random characters is not guessed)."""
    key, previous = core.settings.service_key, core.settings.service_key_previous
    if not key:
        raise Forbidden(errors.DISABLED, "the service API is off on this hub: set REDPACKET_SERVICE_KEY")
    given = bearer(request) or ""
    hub: Hub = request.app.state.hub
    guards: Guards = request.app.state.guards
    # Both compared, always: how long it takes says nothing of which one (or whether) it matched.
    current_ok = same_secret(given, key)
    previous_ok = same_secret(given, previous)
    if current_ok or previous_ok:
        # During a roll (REDPACKET_SERVICE_KEY_PREVIOUS): once "previous" stops counting, drop it.
        hub.metrics.service_key_uses.labels("current" if current_ok else "previous").inc()
        return
    hub.metrics.service_key_failures.inc()
    said = "the service API takes REDPACKET_SERVICE_KEY as its bearer token"
    refuse_wrong_key(request, guards.service_key_failures, "service_key", said)


def _user_ids(value: object, field: str) -> list[UserId]:
    if not isinstance(value, list) or len(value) > MAX_MEMBERS:
        raise InvalidRequest(
            errors.BAD_REQUEST, f"{field} must be a list of user ids (at most {MAX_MEMBERS})"
        )
    return [UserId(id_of(u, errors.USER_NOT_FOUND, "user")) for u in value]


def _role(value: object) -> Role:
    if value not in ("member", "admin"):
        raise InvalidRequest(errors.ROLE_INVALID, "role is member or admin")
    return "admin" if value == "admin" else "member"


async def put_user(request: Request, core: Core, _: UserId) -> dict[str, object]:
    user_id = UserId(path_id(request, "user_id"))
    name = ledger.check_name((await json_body(request)).get("name"))
    return {"user_id": user_id, "name": name, "result": await ledger.put_user(core.db, user_id, name)}


async def put_group(request: Request, core: Core, _: UserId) -> dict[str, object]:
    group_id = GroupId(path_id(request, "group_id"))
    body = await json_body(request)
    version = body.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or not 0 <= version < 2**63:
        raise InvalidRequest(errors.BAD_REQUEST, "version must be a whole number, 0 to 2^63-1")
    can_send = body.get("members_can_send", False)
    if not isinstance(can_send, bool):
        raise InvalidRequest(errors.BAD_REQUEST, "members_can_send must be true or false")
    wanted: dict[UserId, Role] = dict.fromkeys(_user_ids(body.get("members", []), "members"), "member")
    wanted.update(dict.fromkeys(_user_ids(body.get("admins", []), "admins"), "admin"))
    if len(wanted) > MAX_MEMBERS:
        raise InvalidRequest(errors.BAD_REQUEST, f"a group has at most {MAX_MEMBERS} members and admins")
    done = await groups.put_group(
        core.db, core.membership, group_id, body.get("name"), wanted, can_send, version
    )
    hub: Hub = request.app.state.hub
    for u in done.removed:
        await hub.publish(group_id, "member_removed", {"user": u, "by": BY_BACKEND})
    for u, role in sorted(done.added.items()):
        await hub.publish(group_id, "member_added", {"user": u, "role": role, "by": BY_BACKEND})
    for u, role in sorted(done.roles.items()):
        await hub.publish(group_id, "member_role", {"user": u, "role": role, "by": BY_BACKEND})
    return {
        "group_id": group_id,
        "applied": done.applied,
        "version": done.version,
        "created": done.created,
        "added": sorted(done.added),
        "removed": done.removed,
        "roles_changed": sorted(done.roles),
    }


async def add_member(request: Request, core: Core, _: UserId) -> dict[str, object]:
    """One member in (or their role changed): idempotent."""
    group_id = GroupId(path_id(request, "group_id"))
    await groups.require_maker(core.db, group_id, backend=True)
    body = await json_body(request)
    user_id = UserId(id_of(body.get("user_id"), errors.USER_NOT_FOUND, "user_id"))
    role = _role(body.get("role", "member"))
    hub: Hub = request.app.state.hub
    async with core.db.transaction() as tx:
        current, _members_can_send = await groups.role_of(tx, group_id=group_id, user_id=user_id)
    if current is None:
        added = await groups.add_members(core.db, core.membership, group_id, [user_id], role)
        if added:
            await hub.publish(group_id, "member_added", {"user": user_id, "role": role, "by": BY_BACKEND})
    elif current != role:
        await groups.set_role(core.db, core.membership, role, group_id=group_id, user_id=user_id)
        await hub.publish(group_id, "member_role", {"user": user_id, "role": role, "by": BY_BACKEND})
    else:
        # Already so: perhaps a retry of a call that died before telling the hubs. Tell them again (the
        # cache dropped, the user's live sockets given the group): a no-op when they knew.
        await core.membership.changed(group_id, [user_id], "added")
    return {"group_id": group_id, "user_id": user_id, "role": role}


async def remove_member(request: Request, core: Core, _: UserId) -> dict[str, object]:
    group_id = GroupId(path_id(request, "group_id"))
    user_id = UserId(path_id(request, "user_id"))
    await groups.require_maker(core.db, group_id, backend=True)
    removed = await groups.remove_member(core.db, core.membership, group_id=group_id, user_id=user_id)
    if removed:
        await request.app.state.hub.publish(group_id, "member_removed", {"user": user_id, "by": BY_BACKEND})
    return {"group_id": group_id, "user_id": user_id, "removed": removed}


async def topup(request: Request, core: Core, _: UserId) -> dict[str, object]:
    """Fund an account from the app's wallet: paid once per ``request_id``, whoever asks how often."""
    body = await keyed_body(request)
    user_id = UserId(id_of(body.get("user_id"), errors.USER_NOT_FOUND, "user_id"))
    amount, request_id = body.get("amount"), body.get("request_id")
    paid = await ledger.topup(core.db, user_id, amount, request_id, service=True)
    return await _money_answer(core, user_id, amount, request_id, paid)


async def withdraw(request: Request, core: Core, _: UserId) -> dict[str, object]:
    """Take money out of an account to pay it out: debited once per ``request_id``, never below zero."""
    body = await keyed_body(request)
    user_id = UserId(id_of(body.get("user_id"), errors.USER_NOT_FOUND, "user_id"))
    amount, request_id = body.get("amount"), body.get("request_id")
    approve = request.app.state.hub.hooks.approve_payout
    paid = await payouts.withdraw(core.db, user_id, amount, request_id, approve)
    return await _money_answer(core, user_id, amount, request_id, paid)


async def _money_answer(
    core: Core, user_id: UserId, amount: object, request_id: object, paid: bool
) -> dict[str, object]:
    """A top-up's or a withdrawal's answer: ``replay`` when an earlier call with the id had paid it."""
    return {
        "user_id": user_id,
        "amount": amount,
        "request_id": request_id,
        "replay": not paid,
        "balance": await ledger.balance(core.db, user_id),
    }


async def _hold_answer(core: Core, hold: payouts.Hold) -> dict[str, object]:
    return {**hold.view(), "balance": await ledger.balance(core.db, hold.user_id)}


async def hold(request: Request, core: Core, _: UserId) -> dict[str, object]:
    """The first step of a payout that can fail: the money leaves the balance and waits."""
    body = await keyed_body(request)
    user_id = UserId(id_of(body.get("user_id"), errors.USER_NOT_FOUND, "user_id"))
    made = await payouts.hold(
        core.db,
        user_id,
        body.get("amount"),
        body.get("request_id"),
        body.get("expires_in_s"),
        request.app.state.hub.hooks.approve_payout,
    )
    return await _hold_answer(core, made)


async def confirm_hold(request: Request, core: Core, _: UserId) -> dict[str, object]:
    """The payout went through: the held money has left."""
    request_id = (await json_body(request)).get("request_id")
    return await _hold_answer(core, await payouts.settle_hold(core.db, request_id, "confirmed"))


async def release_hold(request: Request, core: Core, _: UserId) -> dict[str, object]:
    """The payout failed: the held money goes back to the balance."""
    request_id = (await json_body(request)).get("request_id")
    return await _hold_answer(core, await payouts.settle_hold(core.db, request_id, "released"))


async def event_page(request: Request, core: Core, _: UserId) -> dict[str, object]:
    """The events webhooks carry, for a backend that pulls, oldest first (the one page convention:
    ``server.hub.httpkit.page``)."""
    ask = page_ask(request, default=EVENTS_PAGE, most=events.MAX_PAGE)
    found = await events.page(core.db, after=ask.after, limit=ask.limit + 1)
    return page("events", found, ask, newest=None if found else await events.last_seq(core.db))


async def account(request: Request, core: Core, _: UserId) -> dict[str, object]:
    """An account's balance and the sum of its journal (equal, or reconciliation reports it)."""
    user_id = UserId(path_id(request, "user_id"))
    return {
        "user_id": user_id,
        "balance": await ledger.balance(core.db, user_id),
        "journal_sum": await journal_sum(core.db, user_id),
    }


async def journal(request: Request, core: Core, _: UserId) -> dict[str, object]:
    """An account's journal, oldest first, in pages (the one page convention: ``server.hub.httpkit.page``)."""
    user_id = UserId(path_id(request, "user_id"))
    ask = page_ask(request, default=JOURNAL_PAGE, most=JOURNAL_PAGE)
    await ledger.balance(core.db, user_id)  # user_not_found for an unknown account
    found = await journal_page(core.db, user_id, after=ask.after, limit=ask.limit + 1)
    newest = None if found else await queries.last_journal_id(core.db, user_id)
    return {"user_id": user_id, **page("entries", found, ask, newest=newest)}


async def send(request: Request, core: Core, _: UserId) -> dict[str, object]:
    """``POST /api/service/packets``: a packet sent by the chat backend — on behalf of ``sender_id`` (who
    must be allowed to send in the group, as on the websocket) or, with ``system``, from an account of
    the backend's own that need not be a member. The same limits and checks as any send, paid from the
    sender's balance, announced in the room as any send; ``request_id`` is required (the sender's, as a
    send's from a socket: a retry answers the same packet and pays once)."""
    body = await keyed_body(request)
    sender = UserId(id_of(body.get("sender_id"), errors.USER_NOT_FOUND, "sender_id"))
    group = GroupId(id_of(body.get("group_id"), errors.GROUP_NOT_FOUND, "group_id"))
    request_id, system = body.get("request_id"), body.get("system", False)
    if not isinstance(request_id, str):
        raise InvalidRequest(errors.BAD_REQUEST, "request_id is required, a string: a retried send pays once")
    if not isinstance(system, bool):
        raise InvalidRequest(errors.BAD_REQUEST, "system is true or false")
    if not await ledger.user_exists(core.db, sender):
        raise NotFound(errors.USER_NOT_FOUND, f"no user {sender}: put it first")
    hub: Hub = request.app.state.hub
    sent = await requests.send(
        hub, body, sender_id=sender, group_id=group, request_id=request_id, system=system
    )
    return {**sent, "group_id": group}


def routes() -> list[Route]:
    def public(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        """The route for ``handler``, behind the service key (no user's token: ``public`` to endpoint)."""

        async def keyed(request: Request, core: Core, user: UserId) -> Any:
            _require_key(request, core)
            return await handler(request, core, user)

        return endpoint(keyed, public=True, service=True)

    return [
        Route("/api/service/users/{user_id}", public(put_user), methods=["PUT"]),
        Route("/api/service/groups/{group_id}", public(put_group), methods=["PUT"]),
        Route("/api/service/groups/{group_id}/members", public(add_member), methods=["POST"]),
        Route("/api/service/groups/{group_id}/members/{user_id}", public(remove_member), methods=["DELETE"]),
        Route("/api/service/topup", public(topup), methods=["POST"]),
        Route("/api/service/withdraw", public(withdraw), methods=["POST"]),
        Route("/api/service/holds", public(hold), methods=["POST"]),
        Route("/api/service/holds/confirm", public(confirm_hold), methods=["POST"]),
        Route("/api/service/packets", public(send), methods=["POST"]),
        Route("/api/service/holds/release", public(release_hold), methods=["POST"]),
        Route("/api/service/events", public(event_page), methods=["GET"]),
        Route("/api/service/accounts/{user_id}", public(account), methods=["GET"]),
        Route("/api/service/accounts/{user_id}/journal", public(journal), methods=["GET"]),
        Route("/api/service/webhooks", public(webhookapi.endpoint_page), methods=["GET"]),
        Route(
            "/api/service/webhooks/{endpoint}/deliveries", public(webhookapi.delivery_page), methods=["GET"]
        ),
        Route(
            "/api/service/webhooks/{endpoint}/deliveries/{event_id}",
            public(webhookapi.delivery),
            methods=["GET"],
        ),
    ]
