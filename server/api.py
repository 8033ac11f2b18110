"""The HTTP API of the money core, served by ``redpacket up``.

A development surface: identities are plain user ids in the request, with no token, so it binds to
127.0.0.1 by default. The websocket hub (with signed tokens) is the way real clients connect.
Every error is ``{"error": {"code": ..., "message": ...}}`` with a stable code.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import asdict
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from server import errors, groups, ledger, packets
from server.core import Core
from server.errors import Conflict, Forbidden, InvalidRequest, NotFound, RedPacketError, Unavailable

log = logging.getLogger(__name__)

_STATUS = {InvalidRequest: 400, Forbidden: 403, NotFound: 404, Conflict: 409, Unavailable: 503}

Handler = Callable[[Request, Core], Awaitable[Any]]


def _error(code: str, message: str, status: int) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status)


def endpoint(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    """Run ``handler`` with the app's Core; turn its result into JSON and its errors into codes."""

    async def run(request: Request) -> Response:
        core: Core = request.app.state.core
        try:
            return JSONResponse(await handler(request, core))
        except RedPacketError as e:
            return _error(e.code, e.message, _STATUS.get(type(e), 400))
        except (json.JSONDecodeError, ValueError, KeyError, TypeError) as e:
            return _error(errors.BAD_REQUEST, f"malformed request: {e}", 400)

    return run


async def _body(request: Request) -> dict[str, Any]:
    data = await request.json()
    if not isinstance(data, dict):
        raise ValueError("the body must be a JSON object")
    return data


def _id(value: object, what: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.isdigit():
        return int(value)
    raise InvalidRequest(errors.BAD_REQUEST, f"{what} must be a whole number")


async def login(request: Request, core: Core) -> dict[str, Any]:
    """Create the user on first use; the dev stand-in for a real login."""
    name = (await _body(request)).get("name")
    user_id = await ledger.user_by_name(core.db, name) if isinstance(name, str) and name.strip() else None
    if user_id is None:
        user_id = await ledger.create_user(core.db, name)  # type: ignore[arg-type]
    return {"user_id": user_id, "balance": await ledger.balance(core.db, user_id)}


async def topup(request: Request, core: Core) -> dict[str, Any]:
    user_id = _id(request.path_params["user_id"], "user_id")
    body = await _body(request)
    await ledger.topup(core.db, user_id, body.get("amount"), body.get("request_id"))
    return {"user_id": user_id, "balance": await ledger.balance(core.db, user_id)}


async def balance(request: Request, core: Core) -> dict[str, Any]:
    user_id = _id(request.path_params["user_id"], "user_id")
    return {"user_id": user_id, "balance": await ledger.balance(core.db, user_id)}


async def create_group(request: Request, core: Core) -> dict[str, Any]:
    body = await _body(request)
    owner = _id(body.get("owner"), "owner")
    name = str(body.get("name") or "")
    gid = await groups.create_group(core.db, owner, name, bool(body.get("members_can_send")))
    return {"group_id": gid}


async def add_members(request: Request, core: Core) -> dict[str, Any]:
    gid = _id(request.path_params["group_id"], "group_id")
    body = await _body(request)
    users = [_id(u, "user_ids[]") for u in body.get("user_ids", [])]
    added = await groups.add_members(core.db, core.membership, gid, users, body.get("role", "member"))
    return {"group_id": gid, "added": added}


async def send(request: Request, core: Core) -> dict[str, Any]:
    gid = _id(request.path_params["group_id"], "group_id")
    body = await _body(request)
    target = body.get("target_user_id")
    p = await packets.send_packet(
        core,
        _id(body.get("sender"), "sender"),
        gid,
        body.get("kind", "lucky"),
        body.get("total"),
        body.get("count"),
        body.get("greeting", ""),
        None if target is None else _id(target, "target_user_id"),
        body.get("request_id"),
    )
    return asdict(p)


async def grab(request: Request, core: Core) -> dict[str, Any]:
    gid = _id(request.path_params["group_id"], "group_id")
    pid = _id(request.path_params["packet_id"], "packet_id")
    user = _id((await _body(request)).get("user"), "user")
    r = await packets.grab(core, pid, gid, user)
    return {"outcome": r.outcome, "packet_id": pid, **asdict(r.grab), "remaining": r.remaining}


async def open_(request: Request, core: Core) -> dict[str, Any]:
    gid = _id(request.path_params["group_id"], "group_id")
    pid = _id(request.path_params["packet_id"], "packet_id")
    user = _id(request.query_params.get("user"), "user")
    v = await packets.open_packet(core, pid, gid, user)
    return {**asdict(v), "duration_ms": v.duration_ms}


async def healthz(request: Request) -> Response:
    core: Core = request.app.state.core
    try:
        await core.redis.ping()
    except Exception as e:
        return _error(errors.REDIS_UNAVAILABLE, str(e), 503)
    try:
        await core.db.fetchone("SELECT 1")
    except Exception as e:
        return _error(errors.DATABASE_UNAVAILABLE, str(e), 503)
    return JSONResponse({"ok": True})


def create_app(core: Core) -> Starlette:
    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        app.state.core = core
        yield

    return Starlette(
        routes=[
            Route("/healthz", healthz),
            Route("/api/login", endpoint(login), methods=["POST"]),
            Route("/api/users/{user_id}/balance", endpoint(balance)),
            Route("/api/users/{user_id}/topup", endpoint(topup), methods=["POST"]),
            Route("/api/groups", endpoint(create_group), methods=["POST"]),
            Route("/api/groups/{group_id}/members", endpoint(add_members), methods=["POST"]),
            Route("/api/groups/{group_id}/packets", endpoint(send), methods=["POST"]),
            Route("/api/groups/{group_id}/packets/{packet_id}/grab", endpoint(grab), methods=["POST"]),
            Route("/api/groups/{group_id}/packets/{packet_id}", endpoint(open_)),
        ],
        lifespan=lifespan,
    )
