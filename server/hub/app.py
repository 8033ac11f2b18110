"""The hub's Starlette app: the websocket at ``/ws`` and the HTTP routes for what is not live.

The lifespan owns the database and Redis pools (``open_core``), the hub (one pub/sub connection) and,
under ``redpacket up``, an in-process credit worker. HTTP callers authenticate with
``Authorization: Bearer <token>``; errors are ``{"error": {"code", "message"}}`` with a stable code.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator, Callable

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Match, Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.types import Scope

from server import errors
from server.core import Core, open_core, reset_writer_when_told
from server.errors import Conflict, Forbidden, InvalidRequest, NotFound
from server.hub import service
from server.hub.gcpolicy import keep_collections_out_of_bursts
from server.hub.handshake import HttpLimits, bounded_http, check_uvicorn
from server.hub.httpkit import (
    CrossOrigin,
    LocalOnly,
    SecurityHeaders,
    cross_origins,
    endpoint,
    error_response,
    id_of,
    json_body,
    path_id,
)
from server.hub.hub import Hub
from server.hub.metrics import HubMetrics, serve_metrics
from server.hub.requests import grab_dict, view_dict
from server.hub.session import websocket_endpoint
from server.hub.tokens import make_token
from server.hub.wire import HubWebSocket
from server.ids import GroupId, PacketId, UserId
from server.money import grabs, groups, ledger, queries
from server.settings import Settings
from server.store.assets import asset_dir

log = logging.getLogger(__name__)


WEB_DIR = asset_dir("web")
# The JavaScript client (an ES module, no build step), served for the demo page and any page: /client/.
CLIENT_DIR = asset_dir("clients/js")
# The HTTP API described in OpenAPI 3.1, served as /openapi.json.
API_DOC = asset_dir("docs") / "openapi.json"


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
    if not request.app.state.hub.tokens.rules.hmac:
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
    body = await json_body(request)
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
    view = await grabs.open_packet(core, packet_id=pid, group_id=group, user_id=user)
    credited = await queries.grab_states(core.db, pid)
    listed = [{**grab_dict(g), "status": credited.get(g.user_id, "grabbed")} for g in view.grabs]
    return {**view_dict(view), "grabs": listed, "status": status}


async def my_packets(request: Request, core: Core, user: UserId) -> dict[str, object]:
    return await queries.sent_and_received(core.db, user)


# /healthz answers within this long whatever hangs behind it: a balancer must tell "Redis away" from "hub
# dead" (each service's check is bounded by it, and they run at once).
HEALTH_SECONDS = 0.8


async def healthz(request: Request) -> Response:
    """Whether this hub reaches Redis and the database, and Redis keeps what it is given (every master's
    eviction policy, read now). Anyone may ask: the answer says which is wrong, never the error's text
    (hosts, users), which goes to the log."""
    core: Core = request.app.state.core
    redis, db = await asyncio.gather(
        core.nodes.read_policies(HEALTH_SECONDS),
        asyncio.wait_for(core.db.fetchone("SELECT 1"), HEALTH_SECONDS),
        return_exceptions=True,
    )
    if isinstance(redis, BaseException):
        log.warning("health check: Redis is unavailable: %s", redis or "it does not answer")
        return error_response(errors.REDIS_UNAVAILABLE, "Redis is unavailable", 503)
    if redis:
        policy = next(iter(redis.values()))
        message = f"a Redis master may drop keys (maxmemory-policy {policy}): grabs are refused"
        return error_response(errors.REDIS_UNAVAILABLE, message, 503)
    if isinstance(db, BaseException):
        log.warning("health check: the database is unavailable: %s", db or "it does not answer")
        return error_response(errors.DATABASE_UNAVAILABLE, "the database is unavailable", 503)
    return JSONResponse({"ok": True})


_HTTP_CODES = {404: errors.NOT_FOUND, 405: errors.METHOD_NOT_ALLOWED}


async def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (no such route or file, wrong method) as the documented JSON error."""
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    detail = exc.detail if isinstance(exc, HTTPException) else "internal error"
    return error_response(_HTTP_CODES.get(status, errors.BAD_REQUEST), str(detail), status)


async def server_error(request: Request, exc: Exception) -> Response:
    """A bug: logged with its traceback; the caller gets the documented JSON error, never a text page."""
    log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return error_response(errors.INTERNAL, "internal error", 500)


def metrics_page(app: Starlette) -> bytes:
    """This hub process's metrics, and under ``redpacket up`` the in-process worker's after them."""
    body: bytes = generate_latest(app.state.metrics.registry)
    beside = getattr(app.state, "beside_metrics", None)
    if beside is not None:
        body += generate_latest(beside)
    return body


# What runs in the hub's process beside it for as long as the hub runs (``redpacket up``: the worker,
# ``worker.main.beside_hub``), given the hub's Core; it yields its metrics, shown after the hub's.
Beside = Callable[[Core], contextlib.AbstractAsyncContextManager[CollectorRegistry]]


class Pages(Mount):
    """The demo page's files, never under ``/api/``: a wrong method on an API route is answered 405
    (``method_not_allowed``), not 404 by a file lookup."""

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        if scope["type"] == "http" and scope["path"].startswith("/api/"):
            return Match.NONE, {}
        return super().matches(scope)


async def openapi(request: Request) -> Response:
    """docs/openapi.json, the HTTP API's description, as the file says it."""
    return Response(API_DOC.read_bytes(), media_type="application/json")


async def metrics(request: Request) -> Response:
    """/metrics on the hub's port, unless REDPACKET_METRICS_PORT gives them a port of their own."""
    if request.app.state.metrics_apart:
        return error_response(errors.NOT_FOUND, "Not Found", 404)
    return Response(metrics_page(request.app), media_type=CONTENT_TYPE_LATEST)


def create_app(
    settings: Settings,
    beside: Beside | None = None,
    manage_gc: bool = False,
    metrics_sock: socket.socket | None = None,
) -> Starlette:
    """The hub app for ``settings``; nothing connects until the lifespan starts. ``manage_gc``: this
    process is the hub's own (``redpacket serve`` / ``up``): keep collections out of bursts
    (``server.hub.gcpolicy``). With ``REDPACKET_METRICS_PORT`` /metrics is answered there instead of on the
    hub's port: on ``metrics_sock`` if the caller bound it (``serve --workers``: one port each)."""
    if not settings.secret and "HS256" in settings.jwt_algorithm_list:
        raise ValueError("REDPACKET_SECRET is required to check HS256 tokens")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        app.state.metrics = hub_metrics = HubMetrics()
        async with open_core(settings) as core, Hub(core, hub_metrics) as hub:
            app.state.core, app.state.hub = core, hub
            hub_metrics.read_pools(core.nodes.connections_in_use, core.db.connections_in_use)
            hub_metrics.read_evicting(lambda: len(core.nodes.evicting_masters()))
            hub_metrics.database.watch(core.db)
            hub_metrics.read_hot(hub.packet_cache.hottest)
            background = [asyncio.create_task(hub_metrics.watch_loop())]
            apart = None
            if settings.metrics_port:  # (bound here unless the command line bound it, to say a busy port)
                sock = metrics_sock or socket.create_server((settings.metrics_host, settings.metrics_port))
                apart = await serve_metrics(sock, lambda: metrics_page(app))
            if manage_gc:  # this process is the hub's own: signals are its to take
                reset_writer_when_told(core)
                background.append(
                    asyncio.create_task(keep_collections_out_of_bursts(hub_metrics.frames_in_so_far))
                )
            try:
                if beside is not None:
                    async with beside(core) as app.state.beside_metrics:
                        yield
                else:
                    yield
            finally:
                for task in background:
                    task.cancel()
                await asyncio.gather(*background, return_exceptions=True)
                if apart is not None:
                    apart.close()

    origins = cross_origins(settings.allowed_origin_list)
    app = Starlette(
        routes=[
            WebSocketRoute("/ws", websocket_endpoint),
            Route("/healthz", healthz),
            Route("/metrics", metrics),
            Route("/openapi.json", openapi),
            Route("/api/login", endpoint(login, public=True), methods=["POST"]),
            Route("/api/me", endpoint(me)),
            Route("/api/me/packets", endpoint(my_packets)),
            Route("/api/topup", endpoint(topup), methods=["POST"]),
            Route("/api/groups", endpoint(create_group), methods=["POST"]),
            Route("/api/groups/{group_id}/members", endpoint(list_members), methods=["GET"]),
            Route("/api/groups/{group_id}/members", endpoint(add_members), methods=["POST"]),
            Route("/api/groups/{group_id}/members/{user_id}", endpoint(remove_member), methods=["DELETE"]),
            Route("/api/groups/{group_id}/admins/{user_id}", endpoint(make_admin), methods=["POST"]),
            Route("/api/packets/{packet_id}", endpoint(packet_detail)),
            # The chat backend's API, behind REDPACKET_SERVICE_KEY (docs/integration.md).
            *service.routes(),
            Mount("/client", StaticFiles(directory=CLIENT_DIR, check_dir=False), name="client"),
            # The demo page: static files, no build step (web/README.md).
            Pages("/", StaticFiles(directory=WEB_DIR, html=True), name="web"),
        ],
        lifespan=lifespan,
        exception_handlers={HTTPException: http_error, Exception: server_error},
        # (The demo's conveniences, when on, for this machine alone: server.hub.httpkit.LocalOnly.)
        middleware=[Middleware(SecurityHeaders)]
        + ([Middleware(LocalOnly)] if settings.dev_login or settings.demo_topup else [])
        # Pages of the allowed origins may use the HTTP API (server.hub.httpkit.CrossOrigin).
        + ([Middleware(CrossOrigin, origins=origins)] if origins else []),
    )
    app.state.metrics_apart = bool(settings.metrics_port)
    return app


def hub_websocket(settings: Settings, app: object = None) -> type[HubWebSocket]:
    """The protocol class to give uvicorn (``ws=``), with the budgets the settings say; the limits it hits
    counted in ``app``'s hub metrics (made by its lifespan, so looked for at each count)."""

    def limited(limit: str) -> None:
        metrics = getattr(getattr(app, "state", None), "metrics", None)
        if isinstance(metrics, HubMetrics):
            metrics.limited.labels(limit).inc()

    return type(
        "HubWebSocket",
        (HubWebSocket,),
        {
            "on_limited": staticmethod(limited),
            "frames_per_second": settings.ws_frames_per_second,
            "bytes_per_second": settings.ws_bytes_per_second,
            "close_seconds": settings.ws_close_seconds,
        },
    )


def uvicorn_config(app: object, settings: Settings) -> uvicorn.Config:
    """How the hub runs under uvicorn: bounded HTTP requests (``server.hub.handshake``), the hub's own
    websocket protocol (``server.hub.wire``), no compression unless asked, frame cap, pings. Raises
    ``UnsupportedUvicorn`` first if the installed uvicorn lacks what the HTTP side uses."""
    check_uvicorn()
    http = bounded_http(settings.handshake_seconds, HttpLimits.of(settings))
    return uvicorn.Config(
        # (uvicorn.Config types app as its ASGI protocol; Starlette's app is one, typed otherwise.)
        app,  # type: ignore[arg-type]
        http=http,
        ws=hub_websocket(settings, app),
        ws_per_message_deflate=settings.ws_compression,
        ws_max_size=settings.ws_max_frame_bytes,
        ws_ping_interval=settings.ws_ping_interval,
        ws_ping_timeout=settings.ws_ping_timeout,
        timeout_graceful_shutdown=settings.shutdown_seconds,
        log_level="warning",
        access_log=False,
    )
