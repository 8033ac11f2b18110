"""The HTTP API's plumbing, shared by the user routes (``server.hub.app``) and the chat backend's
(``server.hub.service``): JSON in, JSON out, every error as ``{"error": {"code", "message", ...}}`` with a
stable code and its status, the caller's user from a bearer token."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server import errors, text
from server.core import Core, unavailable
from server.errors import Conflict, Forbidden, InvalidRequest, NotFound, RedPacketError, TooMany, Unavailable
from server.hub.ratelimit import KeyedBuckets
from server.hub.tokens import TokenError, Tokens
from server.ids import MAX_ID, UserId, ids_as_text, ids_from_text
from server.money import ledger
from server.settings import is_loopback

_STATUS = {
    TooMany: 429,
    InvalidRequest: 400,
    Forbidden: 403,
    NotFound: 404,
    Conflict: 409,
    Unavailable: 503,
    TokenError: 401,
}

Handler = Callable[[Request, Core, UserId], Awaitable[Any]]
NO_USER = UserId(0)


def error_response(
    code: str, message: str, status: int, details: dict[str, Any] | None = None
) -> JSONResponse:
    return JSONResponse({"error": {**(details or {}), "code": code, "message": message}}, status_code=status)


def bearer(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    return auth[7:] if auth.lower().startswith("bearer ") else None


async def user_of(request: Request) -> UserId:
    """The user the request's bearer token names (the hub's token check)."""
    tokens: Tokens = request.app.state.hub.tokens
    return await tokens.user(bearer(request))


def client_address(request: Request) -> str:
    """Who is calling, as far as this hub can tell: the peer's address (behind a proxy, the proxy's;
    a trusted proxy's X-Forwarded-For, uvicorn's FORWARDED_ALLOW_IPS). An IPv6 peer counts as its /64:
    one machine is handed a whole /64 and could otherwise take a fresh allowance per address."""
    host = request.client.host if request.client else ""
    if ":" in host:
        with contextlib.suppress(ValueError):
            return str(ipaddress.ip_network(f"{host}/64", strict=False))
    return host


def limit(request: Request, name: str, buckets: KeyedBuckets, key: object) -> None:
    """One request against ``buckets``' ``key``: 429 ``rate_limited`` past it."""
    if not buckets.take(key, time.monotonic()):
        request.app.state.hub.metrics.limited.labels(name).inc()
        raise TooMany(errors.RATE_LIMITED, f"too many requests from this {name}: slow down")


async def known_user(core: Core, user: UserId) -> UserId:
    """``user`` if the database has it; a valid token for a user never made (a backend that has not
    provisioned it yet) is ``user_not_found``, on every route as on the websocket (close 4004)."""
    if not await ledger.user_exists(core.db, user):
        raise NotFound(
            errors.USER_NOT_FOUND, f"no user {user}: the token names a user this hub does not have"
        )
    return user


def endpoint(
    handler: Handler, public: bool = False, service: bool = False
) -> Callable[[Request], Awaitable[Response]]:
    """Run ``handler`` with the Core and the caller's user id; JSON in, JSON out, errors as codes.
    Requests are limited per client address (not the chat backend's: ``service``) and per user (not
    ``public`` ones, which name none)."""

    async def run(request: Request) -> Response:
        core: Core = request.app.state.core
        text = False
        try:
            text = text_ids(request)
            if not service:  # (the chat backend's routes are limited by their key: ``server.hub.service``)
                limit(request, "address", request.app.state.hub.http_by_address, client_address(request))
            # A public route names no user: its handler is given NO_USER.
            user = NO_USER if public else await known_user(core, await user_of(request))
            if not public:
                limit(request, "user", request.app.state.hub.http_by_user, user)
            answer = await handler(request, core, user)
            return JSONResponse(ids_as_text(answer) if text else answer)
        except RedPacketError as e:
            details = ids_as_text(e.details) if text and e.details else e.details
            return error_response(e.code, e.message, _STATUS.get(type(e), 400), details)
        except (json.JSONDecodeError, ValueError, KeyError, TypeError) as e:
            return error_response(errors.BAD_REQUEST, f"malformed request: {e}", 400)
        except ClientDisconnect:  # the caller went (or its body was refused as too large): nobody to answer
            return Response(status_code=400)
        except Exception as e:
            down = unavailable(e)
            if down is not None:
                return error_response(down.code, down.message, 503)
            raise  # a bug: the app's exception handler answers the documented JSON error

    return run


# The request header by which a caller asks for every user, group and packet id as its decimal string, in
# answers and in bodies (``server.ids``): ``number`` (the default) or ``string``.
IDS_HEADER = "redpacket-ids"


def text_ids(request: Request) -> bool:
    """Whether the caller asked for ids as text (``Redpacket-Ids: string``); another value than the two
    is ``bad_request``, never taken for the default."""
    value = request.headers.get(IDS_HEADER, "number").strip().lower()
    if value not in ("number", "string"):
        raise InvalidRequest(errors.BAD_REQUEST, "Redpacket-Ids is number (the default) or string")
    return value == "string"


async def json_body(request: Request) -> dict[str, Any]:
    """The request's JSON object (the body's size is bounded before it is read: ``server.hub.handshake``),
    its ids as integers if they came as text (``Redpacket-Ids: string``)."""
    try:
        data = json.loads(await request.body())
    except RecursionError:  # (the C parser's own depth guard) nested past any bound: one answer, no trace
        raise InvalidRequest(errors.BAD_REQUEST, "the body is nested too deeply") from None
    if not isinstance(data, dict):
        raise InvalidRequest(errors.BAD_REQUEST, "the body must be a JSON object")
    problem = text.message_problem(data, request.app.state.core.settings.max_nesting)
    if problem is not None:
        raise InvalidRequest(errors.BAD_REQUEST, problem)
    if text_ids(request):
        try:
            return dict(ids_from_text(data))
        except ValueError as e:
            raise InvalidRequest(errors.BAD_REQUEST, str(e)) from None
    return data


def id_of(value: object, unknown: str, what: str) -> int:
    """An id from a body: ``bad_request`` unless it is a JSON integer (a string of digits only with
    ``Redpacket-Ids: string``, which ``json_body`` has made an integer: an id that moves money is typed as
    the caller said), ``unknown`` (not found) when no id can be that number."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRequest(errors.BAD_REQUEST, f"{what} must be a whole number")
    if not 1 <= value <= MAX_ID:
        raise NotFound(unknown, f"no {what} {value}")
    return value


def path_id(request: Request, name: str) -> int:
    unknown = {"group_id": errors.GROUP_NOT_FOUND, "user_id": errors.USER_NOT_FOUND}
    value = request.path_params[name]
    if isinstance(value, str) and value.isascii() and value.isdigit():
        value = int(value)  # (a path holds text: its digits are the id)
    return id_of(value, unknown.get(name, errors.PACKET_NOT_FOUND), name)


# What every HTTP answer carries (the demo page above all): its scripts and styles from its own files only
# (it has no inline script or style), its sockets to this hub only, never framed by another site, its
# types as declared, no address sent on to other sites.
SECURITY_HEADERS: list[tuple[bytes, bytes]] = [
    (
        b"content-security-policy",
        b"default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self';"
        b" object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
    ),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
]


# What a page of another origin may send the HTTP API (the CORS preflight's answer).
CORS_METHODS = ("GET", "POST", "PUT", "DELETE")
CORS_HEADERS = ("authorization", "content-type", IDS_HEADER)
# What such a page may use: the user routes, the JS client, the API's description (not the metrics, the
# health check or the demo page).
CORS_PATHS = ("/api/", "/client/", "/openapi.json")


class CrossOrigin:
    """ASGI middleware: the pages of ``REDPACKET_ALLOWED_ORIGINS`` (the chat app's own web client, on its
    own origin) may import ``/client/redpacket.js`` and call the user routes of the HTTP API; Starlette's
    ``CORSMiddleware`` answers their preflights and marks their answers. No credentials: the hub sets and
    reads no cookie, a page sends its user's token in ``Authorization`` (so ``Access-Control-Allow-
    Credentials`` is never sent, and a page cannot make a user's browser call the hub with a login of its
    own). A preflight from an origin not listed is 403 ``origin_not_allowed``; the chat backend's
    ``/api/service/`` routes take no cross-origin call at all (its key never belongs in a browser)."""

    def __init__(self, app: ASGIApp, origins: tuple[str, ...]) -> None:
        self.app = app
        self.origins = frozenset(origins)
        self.cors = CORSMiddleware(
            app,
            allow_origins=sorted(origins),
            allow_methods=CORS_METHODS,
            allow_headers=CORS_HEADERS,
            allow_credentials=False,
            max_age=600,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if not path.startswith(CORS_PATHS) or path.startswith("/api/service/"):
            await self.app(scope, receive, send)  # (no CORS: the page gets nothing it may read)
            return
        headers = Headers(scope=scope)
        origin = headers.get("origin")
        preflight = scope["method"] == "OPTIONS" and "access-control-request-method" in headers
        if preflight and origin is not None and origin.lower().rstrip("/") not in self.origins:
            refusal = f"pages of {origin} may not call this hub (REDPACKET_ALLOWED_ORIGINS)"
            await error_response(errors.ORIGIN_NOT_ALLOWED, refusal, 403)(scope, receive, send)
            return
        await self.cors(scope, receive, send)


def cross_origins(allowed: tuple[str, ...]) -> tuple[str, ...]:
    """The origins whose pages may call the HTTP API: ``REDPACKET_ALLOWED_ORIGINS`` but ``self`` (the
    hub's own pages need no CORS)."""
    return tuple(o for o in allowed if o != "self")


class SecurityHeaders:
    """ASGI middleware: ``SECURITY_HEADERS`` on every HTTP response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *SECURITY_HEADERS]
            await send(message)

        await self.app(scope, receive, send_with_headers)


def _local_request(scope: Scope) -> bool:
    """Whether a request reached this hub from this machine as itself: a Host naming loopback, and no
    proxy's forwarding header (a page of another site resolving its name to 127.0.0.1 — DNS rebinding —
    sends its own name as Host; a proxy in front brings the world)."""
    host = ""
    for name, value in scope.get("headers", []):
        if name in (b"x-forwarded-for", b"forwarded", b"x-real-ip"):
            return False
        if name == b"host":
            host = value.decode("latin-1")
    name = host[1:].split("]", 1)[0] if host.startswith("[") else host.rsplit(":", 1)[0]
    return is_loopback(name.lower())


class LocalOnly:
    """ASGI middleware of a hub with dev login or demo money on: every request (HTTP or websocket) that
    is not ``_local_request`` is refused 403 ``not_local``, so that the demo's conveniences stay on this
    machine even when a browser or a proxy would carry them further."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or _local_request(scope):
            await self.app(scope, receive, send)
            return
        message = "this demo hub (dev login, demo money) answers requests from this machine only"
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008, "reason": errors.NOT_LOCAL})
            return
        await error_response(errors.NOT_LOCAL, message, 403)(scope, receive, send)
