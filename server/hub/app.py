"""The hub's Starlette app: the websocket at ``/ws`` and the HTTP routes for what is not live.

The lifespan owns the database and Redis pools (``open_core``), the hub (one pub/sub connection) and,
under ``redpacket up``, an in-process credit worker. HTTP callers authenticate with
``Authorization: Bearer <token>``; errors are ``{"error": {"code", "message"}}`` with a stable code.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import socket
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
from server.hub import service, userapi
from server.hub.console import api as console_api
from server.hub.gcpolicy import keep_collections_out_of_bursts
from server.hub.guards import Guards
from server.hub.handshake import check_uvicorn
from server.hub.httpkit import (
    CrossOrigin,
    EveryAnswer,
    LocalOnly,
    cross_origins,
    error_response,
)
from server.hub.hub import Hub
from server.hub.metrics import HubMetrics
from server.hub.operations import operations_app, options, serve_operations
from server.hub.session import websocket_endpoint
from server.hub.wire import HubWebSocket
from server.live import seen
from server.settings import Settings
from server.stopping import stop
from server.store.assets import asset_dir

log = logging.getLogger(__name__)


WEB_DIR = asset_dir("web")
# The JavaScript client (an ES module, no build step), served for the demo page and any page: /client/.
CLIENT_DIR = asset_dir("clients/js")
# The HTTP API described in OpenAPI 3.1, served as /openapi.json.
API_DOC = asset_dir("docs") / "openapi.json"


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


async def _say_alive(core: Core, hub: Hub) -> None:
    """This hub among the processes seen (``server.live.seen``), every few seconds while it runs."""
    while True:
        try:
            await seen.beat(core, "hub", hub.id, connections=sum(len(c) for c in hub.by_user.values()))
        except Exception as e:  # (Redis away: the next beat says it again)
            log.debug("could not say this hub is alive: %s", e)
        await asyncio.sleep(seen.BEAT_SECONDS)


_HTTP_CODES = {404: errors.NOT_FOUND, 405: errors.METHOD_NOT_ALLOWED}


async def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (no such route or file, wrong method) as the documented JSON error."""
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    detail = exc.detail if isinstance(exc, HTTPException) else "internal error"
    answer = error_response(_HTTP_CODES.get(status, errors.BAD_REQUEST), str(detail), status)
    if status == 405:  # RFC 9110: a 405 says what the path takes (every route of the path, not only one)
        # (A static file's refusal says its own: StaticFiles' GET, HEAD.)
        theirs = (getattr(exc, "headers", None) or {}).get("Allow", "")
        answer.headers["allow"] = ", ".join(allowed_methods(request)) or theirs
    return answer


def allowed_methods(request: Request) -> list[str]:
    methods: set[str] = set()
    for route in request.app.routes:
        if isinstance(route, Route) and route.matches(request.scope)[0] != Match.NONE:
            methods |= route.methods or set()
    return sorted(methods)


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
    (``method_not_allowed``), not 404 by a file lookup. Nor the console's page (``web/console``), which is
    served beside the metrics (``server.hub.operations``)."""

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        if scope["type"] == "http" and scope["path"].startswith(("/api/", "/console")):
            return Match.NONE, {}
        return super().matches(scope)


@functools.cache
def _api_doc_around_servers() -> tuple[bytes, bytes]:
    """docs/openapi.json as the bytes before and after its ``servers`` value, read once."""
    doc = {**json.loads(API_DOC.read_bytes()), "servers": None}
    before, _, after = json.dumps(doc, ensure_ascii=False).encode().partition(b'"servers": null')
    return before + b'"servers": ', after


async def openapi(request: Request) -> Response:
    """docs/openapi.json, the HTTP API's description, its ``servers`` saying where this hub is (as the
    caller reached it: a client generated from it calls this hub, not the file's default address)."""
    before, after = _api_doc_around_servers()
    servers = json.dumps([{"url": str(request.base_url).rstrip("/")}]).encode()
    # (Built from the request's Host: a cache in front must keep one answer per host.)
    return Response(before + servers + after, media_type="application/json", headers={"vary": "Host"})


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
        app.state.guards = guards = Guards(settings)
        async with open_core(settings) as core, Hub(core, hub_metrics) as hub:
            await guards.start()
            app.state.core, app.state.hub = core, hub
            hub_metrics.read_pools(core.nodes.connections_in_use, core.db.connections_in_use)
            hub_metrics.read_evicting(lambda: len(core.nodes.evicting_masters()))
            hub_metrics.database.watch(core.db)
            hub_metrics.read_hot(hub.packet_cache.hottest)
            hub_metrics.read_batcher(lambda: (core.batcher.batches, core.batcher.calls))
            apart = None
            if settings.metrics_port:  # (bound here unless the command line bound it, to say a busy port)
                sock = metrics_sock or socket.create_server((settings.metrics_host, settings.metrics_port))
                console = console_api.routes() if settings.console_key else []
                ops = operations_app(settings, lambda: metrics_page(app), console, http_error)
                ops.state.core, ops.state.hub, ops.state.guards = core, hub, guards
                apart = await serve_operations(sock, ops, settings)  # (a failed start leaves nothing)
            background = [
                asyncio.create_task(hub_metrics.watch_loop()),
                asyncio.create_task(_say_alive(core, hub)),
            ]
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
                await stop(background, "the hub's timers")
                if apart is not None:
                    await apart.close()

    origins = cross_origins(settings.allowed_origin_list)
    app = Starlette(
        routes=[
            WebSocketRoute("/ws", websocket_endpoint),
            Route("/healthz", healthz),
            Route("/metrics", metrics),
            Route("/openapi.json", openapi),
            # The user routes (a user's token), and the chat backend's API behind REDPACKET_SERVICE_KEY
            # (docs/integration.md).
            *userapi.routes(),
            *service.routes(),
            # The operators' console only where asked (REDPACKET_CONSOLE_ON_HUB_PORT): else beside /metrics.
            *(console_api.routes() if settings.console_key and settings.console_on_hub_port else []),
            Mount("/client", StaticFiles(directory=CLIENT_DIR, check_dir=False), name="client"),
            # The demo page: static files, no build step (web/README.md).
            Pages("/", StaticFiles(directory=WEB_DIR, html=True), name="web"),
        ],
        lifespan=lifespan,
        exception_handlers={HTTPException: http_error},
        # (The demo's conveniences, when on, for this machine alone: server.hub.httpkit.LocalOnly.)
        middleware=[Middleware(EveryAnswer)]
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
    return uvicorn.Config(
        # (uvicorn.Config types app as its ASGI protocol; Starlette's app is one, typed otherwise.)
        app,  # type: ignore[arg-type]
        ws=hub_websocket(settings, app),
        ws_per_message_deflate=settings.ws_compression,
        ws_max_size=settings.ws_max_frame_bytes,
        ws_ping_interval=settings.ws_ping_interval,
        ws_ping_timeout=settings.ws_ping_timeout,
        timeout_graceful_shutdown=settings.shutdown_seconds,
        # Logging, the bounded HTTP protocol, X-Forwarded-For only from the proxies named: as the
        # operations listener has them (``server.hub.operations.options``).
        **options(settings),
    )
