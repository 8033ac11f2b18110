"""The console's HTTP API (``/api/console/*``, in docs/openapi.json) and its page (``/console/``).

Every route but the sign-in takes ``Authorization: Bearer <session token>`` (``server.hub.console.sessions``):
never the service key nor a user's token. A wrong key is counted per address like a wrong service key
(``429`` past the allowance). The one write, lifting a user's block or throttle, is logged with the
session's id. Reads are the ledger's and Redis's as they stand (``server.hub.console.views``, ``books``)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from server import errors
from server.core import Core
from server.errors import InvalidRequest, NotFound, Unavailable
from server.hub.console import books, sessions, views
from server.hub.guards import Guards, refuse_wrong_key
from server.hub.httpkit import Handler, bearer, client_address, endpoint, json_body, path_id
from server.hub.hub import Hub
from server.hub.tokens import TokenError
from server.ids import PacketId, UserId
from server.live import bots
from server.money import ledger
from server.signing import same_secret
from server.store.assets import asset_dir

log = logging.getLogger(__name__)

PAGE_DIR = asset_dir("web") / "console"
# The longest a console read takes before it is answered 503 (the books' parts have their own, shorter).
ANSWER_SECONDS = 5


def _operator(request: Request, core: Core) -> str:
    """The session's id, if the request carries a session token the console key signed, still valid."""
    verdict, sid = sessions.check(core.settings.console_key, bearer(request) or "", ledger.now_ms())
    if verdict == "expired":
        raise TokenError(errors.TOKEN_EXPIRED, "the console session has expired: sign in again")
    if verdict != "ok":
        raise TokenError(errors.TOKEN_INVALID, "sign in to the console first (POST /api/console/session)")
    return sid


async def sign_in(request: Request, core: Core, _: UserId) -> dict[str, object]:
    key = (await json_body(request)).get("key")
    if not isinstance(key, str) or not key:
        raise InvalidRequest(errors.BAD_REQUEST, "key is the console key (REDPACKET_CONSOLE_KEY)")
    if same_secret(key, core.settings.console_key):
        s = sessions.open_session(
            core.settings.console_key, ledger.now_ms(), core.settings.console_session_minutes
        )
        log.warning("console: session %s opened from %s", s.id, client_address(request))
        return {"token": s.token, "expires_ms": s.expires_ms}
    log.warning("console: a wrong key from %s", client_address(request))
    guards: Guards = request.app.state.guards
    refuse_wrong_key(request, guards.console_key_failures, "console_key", "that is not the console key")


async def packet(request: Request, core: Core, _: UserId) -> dict[str, object]:
    pid = PacketId(path_id(request, "packet_id"))
    found = await views.packet(core, pid)
    if found is None:
        raise NotFound(errors.PACKET_NOT_FOUND, f"no packet {pid}")
    return found


async def user(request: Request, core: Core, _: UserId) -> dict[str, object]:
    uid = UserId(path_id(request, "user_id"))
    hub: Hub = request.app.state.hub
    found = await views.user(core, uid, len(hub.by_user.get(uid, ())), hub.id)
    if found is None:
        raise NotFound(errors.USER_NOT_FOUND, f"no user {uid}")
    return found


async def lift(request: Request, core: Core, _: UserId) -> dict[str, object]:
    uid = UserId(path_id(request, "user_id"))
    if not await ledger.user_exists(core.db, uid):
        raise NotFound(errors.USER_NOT_FOUND, f"no user {uid}")
    lifted = await bots.lift(core, uid)
    sid = request.scope["console_session"]
    log.warning("console: session %s lifted the block and throttle of user %s (%s)", sid, uid, lifted)
    return {"user_id": uid, "lifted": lifted}


async def the_books(request: Request, core: Core, _: UserId) -> dict[str, object]:
    return await books.books(core)


async def live(request: Request, core: Core, _: UserId) -> dict[str, object]:
    """This hub process's figures now (the page draws them over time)."""
    hub: Hub = request.app.state.hub
    registry = hub.metrics.registry

    def sample(name: str, **labels: str) -> float:
        return registry.get_sample_value(name, labels) or 0.0

    won = sample("redpacket_grab_outcomes_total", outcome="won")
    waiting = await books.outbox(core)
    return {
        "at_ms": ledger.now_ms(),
        "hub": hub.id,
        "connections": int(sample("redpacket_hub_connections")),
        "grabs_won_total": int(won),
        "frames_in_total": int(sample("redpacket_hub_frames_in_total")),
        "credit_backlog": waiting["total"],
        "credit_lag_ms": waiting["lag_ms"],
    }


def _operators_only(handler: Handler, read: bool = True) -> Callable[[Request], Awaitable[Response]]:
    """``handler`` for a request with a valid session; a ``read`` answered within ``ANSWER_SECONDS``
    (else 503). The one write (a lift) is not cut short: it would be answered 503 when it had happened."""

    async def checked(request: Request, core: Core, user: UserId) -> Any:
        request.scope["console_session"] = _operator(request, core)
        if not read:
            return await handler(request, core, user)
        try:
            async with asyncio.timeout(ANSWER_SECONDS):
                return await handler(request, core, user)
        except TimeoutError:
            raise Unavailable(
                errors.DATABASE_UNAVAILABLE, f"the ledger or Redis did not answer within {ANSWER_SECONDS} s"
            ) from None

    return endpoint(checked, public=True, service=True)


async def _to_page(request: Request) -> Response:
    return RedirectResponse("/console/", status_code=308)


def routes() -> list[BaseRoute]:
    """The console's routes, for an app whose state holds the hub's ``core``, ``hub`` and ``guards``."""
    return [
        Route("/api/console/session", endpoint(sign_in, public=True, service=True), methods=["POST"]),
        Route("/api/console/packets/{packet_id}", _operators_only(packet), methods=["GET"]),
        Route("/api/console/users/{user_id}", _operators_only(user), methods=["GET"]),
        Route("/api/console/users/{user_id}/lift", _operators_only(lift, read=False), methods=["POST"]),
        Route("/api/console/books", _operators_only(the_books), methods=["GET"]),
        Route("/api/console/live", _operators_only(live), methods=["GET"]),
        Route("/console", _to_page, methods=["GET", "HEAD"]),
        Mount("/console", StaticFiles(directory=PAGE_DIR, html=True, check_dir=False), name="console"),
    ]
