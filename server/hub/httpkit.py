"""The HTTP API's plumbing, shared by the user routes (``server.hub.app``) and the chat backend's
(``server.hub.service``): JSON in, JSON out, every error as ``{"error": {"code", "message", ...}}`` with a
stable code and its status, the caller's user from a bearer token."""

from __future__ import annotations

import contextlib
import contextvars
import ipaddress
import json
import logging
import math
import re
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
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

log = logging.getLogger(__name__)

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


def come_back(e: TooMany) -> dict[str, str]:
    """What a 429 says of when to come back: ``Retry-After`` (RFC 9110, whole seconds) and the
    ``RateLimit-Limit``, ``-Remaining`` and ``-Reset`` fields of the IETF's RateLimit header draft."""
    seconds = str(max(1, math.ceil(e.retry_after_s)))
    return {
        "retry-after": seconds,
        "ratelimit-limit": str(e.allowance),
        "ratelimit-remaining": "0",
        "ratelimit-reset": seconds,
    }


def error_response(
    code: str, message: str, status: int, details: dict[str, Any] | None = None
) -> JSONResponse:
    error = {**(details or {}), "code": code, "message": message}
    if rid := request_id.get():  # (set for every HTTP request: ``EveryAnswer``)
        error["request_id"] = rid
    return JSONResponse({"error": error}, status_code=status)


def bearer(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    return auth[7:] if auth.lower().startswith("bearer ") else None


async def user_of(request: Request) -> UserId:
    """The user the request's bearer token names (the hub's token check)."""
    tokens: Tokens = request.app.state.guards.tokens
    return await tokens.user(bearer(request))


def client_address(request: Request) -> str:
    """Who is calling, as far as this hub can tell: the peer's address (behind a proxy, the proxy's;
    the X-Forwarded-For of a proxy named in REDPACKET_TRUSTED_PROXIES). An IPv6 peer counts as its /64:
    one machine is handed a whole /64 and could otherwise take a fresh allowance per address."""
    host = request.client.host if request.client else ""
    if ":" in host:
        with contextlib.suppress(ValueError):
            return str(ipaddress.ip_network(f"{host}/64", strict=False))
    return host


def limit(request: Request, name: str, buckets: KeyedBuckets, key: object, said: str = "") -> None:
    """One request against ``buckets``' ``key``: 429 ``rate_limited`` past it (saying ``said``), counted
    in ``redpacket_hub_limited_total{limit=name}``."""
    now = time.monotonic()
    if not buckets.take(key, now):
        request.app.state.hub.metrics.limited.labels(name).inc()
        raise TooMany(
            errors.RATE_LIMITED,
            said or f"too many requests from this {name}: slow down",
            retry_after_s=buckets.wait(key, now),
            allowance=buckets.burst,
        )


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
                limit(request, "address", request.app.state.guards.http_by_address, client_address(request))
            # A public route names no user: its handler is given NO_USER.
            user = NO_USER if public else await known_user(core, await user_of(request))
            if not public:
                limit(request, "user", request.app.state.guards.http_by_user, user)
            answer = await handler(request, core, user)
            return JSONResponse(ids_as_text(answer) if text else answer)
        except RedPacketError as e:
            details = ids_as_text(e.details) if text and e.details else e.details
            answer = error_response(e.code, e.message, _STATUS.get(type(e), 400), details)
            if isinstance(e, TooMany):
                answer.headers.update(come_back(e))
            return answer
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


def _not_whole(number: str) -> float:
    """No field of the API is a fraction, and JSON Schema's ``integer`` also matches ``2147.0``: a number
    written with a fraction or an exponent is refused by what it is, never rounded (money never moves on a
    float, and ``9007199254740993.0`` is not the integer it looks like)."""
    raise InvalidRequest(
        errors.BAD_REQUEST,
        f"{number[:40]} is not a JSON integer: amounts, ids and counts are written without a fraction or an"
        " exponent (2147, not 2147.0)",
    )


def _not_json(constant: str) -> float:
    raise InvalidRequest(errors.BAD_REQUEST, f"{constant} is not JSON")


async def json_body(request: Request) -> dict[str, Any]:
    """The request's JSON object (the body's size is bounded before it is read: ``server.hub.handshake``),
    its ids as integers if they came as text (``Redpacket-Ids: string``)."""
    try:
        data = json.loads(await request.body(), parse_float=_not_whole, parse_constant=_not_json)
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


IDEMPOTENCY_HEADER = "idempotency-key"


async def keyed_body(request: Request) -> dict[str, Any]:
    """``json_body`` of a call that moves money once per ``request_id``: the ``Idempotency-Key`` header
    (what generic HTTP retry logic sends) is taken as the ``request_id`` when the body has none; both given
    must be equal (``bad_request`` otherwise: which one a retry would be keyed by is not guessed)."""
    body = await json_body(request)
    key = request.headers.get(IDEMPOTENCY_HEADER)
    if key is None:
        return body
    if "request_id" in body and body["request_id"] != key:
        raise InvalidRequest(
            errors.BAD_REQUEST, "Idempotency-Key and request_id differ: give one, or the same in both"
        )
    return {**body, "request_id": key}


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


# Every list of the HTTP API is paged the same way (docs/integration.md, "Lists"): ``?after=<cursor>&
# limit=<n>`` in, ``{<items>: [...], "next": <cursor>, "more": <bool>}`` out. The cursor is the id of the
# last item given (``next``: ``after`` again on an empty page, never null); ``more`` says whether a next
# page has any item; a cursor past every item the list can have is ``bad_request`` on every list (a reader
# that stored a wrong cursor would otherwise skip what comes after it).


@dataclass(frozen=True)
class PageAsk:
    after: int
    limit: int


def page_ask(request: Request, *, default: int, most: int) -> PageAsk:
    """The page a list's query asks for: ``after`` 0 (from the start) up to 2^63 - 1, ``limit`` 1 to
    ``most`` (``default`` when not given)."""
    given = (request.query_params.get("after", "0"), request.query_params.get("limit", str(default)))
    # Plain ASCII digits only, at most 19 (what ``int`` would also take — "+5", " 5", "5_0", "٥" — is not a
    # number a cursor ever was).
    if not all(v.isascii() and v.isdigit() and len(v) <= 19 for v in given):
        raise InvalidRequest(errors.BAD_REQUEST, "after and limit are whole numbers, in decimal digits")
    after, limit = int(given[0]), int(given[1])
    if not 0 <= after <= MAX_ID or not 1 <= limit <= most:
        raise InvalidRequest(errors.BAD_REQUEST, f"after is 0 to {MAX_ID}, limit 1 to {most}")
    return PageAsk(after, limit)


def page(
    name: str,
    found: Sequence[Mapping[str, Any]],
    ask: PageAsk,
    *,
    cursor: str = "id",
    newest: int | None = None,
) -> dict[str, object]:
    """The answer for one page of ``name``: ``found`` is what the query read with ``limit + 1`` (the one
    more says whether there is a next page). ``newest`` is the largest cursor the list has now (None when
    the list is read newest first, where ``after`` counts down and any cursor is inside it): an ``after``
    past it with nothing found is ``bad_request``."""
    if not found and newest is not None and ask.after > newest:
        raise InvalidRequest(errors.BAD_REQUEST, f"after is past the last item of the list ({newest})")
    items = list(found[: ask.limit])
    return {name: items, "next": items[-1][cursor] if items else ask.after, "more": len(found) > ask.limit}


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
CORS_HEADERS = ("authorization", "content-type", IDS_HEADER, IDEMPOTENCY_HEADER, "x-request-id")
# What such a page may read of an answer beyond the simple headers: its request id, when to come back.
CORS_EXPOSED = ("x-request-id", "retry-after", "ratelimit-limit", "ratelimit-remaining", "ratelimit-reset")
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
            expose_headers=CORS_EXPOSED,
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


# Every HTTP answer names its request (``X-Request-Id``; an error's body too, ``request_id``), so a support
# ticket leads to the hub's log line: the caller's own id when it sent a plain one (a proxy's, say), else one
# made here.
REQUEST_ID_HEADER = "x-request-id"
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")
request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")


def new_request_id(given: str | None) -> str:
    return given if given is not None and _REQUEST_ID.fullmatch(given) else secrets.token_hex(8)


class EveryAnswer:
    """ASGI middleware: ``SECURITY_HEADERS`` and the request's id on every HTTP answer, ``Cache-Control:
    no-store`` on every answer of the API (a token, a balance, a journal: nothing a cache may keep), and
    the answer to a request that failed on a bug."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = new_request_id(Headers(scope=scope).get(REQUEST_ID_HEADER))
        request_id.set(rid)
        extra = [*SECURITY_HEADERS, (REQUEST_ID_HEADER.encode(), rid.encode())]
        api = scope["path"].startswith("/api/")
        if api:
            extra.append((b"cache-control", b"no-store"))

        status = 0
        began = time.perf_counter()

        async def send_with_headers(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []), *extra]
            await send(message)

        try:
            await self.app(scope, receive, send_with_headers)
        except Exception:
            # A bug: logged with its traceback and the request's id; the caller gets the documented JSON
            # error (with these headers too), never a text page.
            log.exception("%s %s failed (request %s)", scope["method"], scope["path"], rid)
            if status:
                raise
            await error_response(errors.INTERNAL, "internal error", 500)(scope, receive, send_with_headers)
        finally:
            if api and status:
                route = getattr(scope.get("route"), "path", "unmatched")
                metrics = scope["app"].state.hub.metrics
                metrics.http_answered(route, scope["method"], status, time.perf_counter() - began)


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
