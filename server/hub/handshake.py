"""Bounded HTTP requests: uvicorn's HTTP protocol with its holes closed.

- **A request must arrive whole in time.** uvicorn waits for the first request of a connection (and for
  the next one after a response) for as long as the peer likes: a client that connects and sends
  nothing, or trickles its headers, holds a file descriptor forever (a hub has ~20,000). Here it gets
  ``408 Request Timeout`` and the connection is closed ``handshake_seconds`` after it opened (or after the
  previous response), unless its request or upgrade has arrived whole by then.
- **A request is bounded before the app sees it** (``HttpLimits``): its request line and headers together
  (``431``, checked as the bytes arrive, so an endless header is never held whole), the number of its
  headers (``431``), its body — by ``Content-Length`` before anything is read (``413``), and as it arrives
  when chunked. The chat backend's routes (``/api/service/``) take larger bodies than a user's.
Every answer carries the HTTP API's JSON error (``request_timeout``, ``request_too_large``).

What happens after the upgrade is the hub's own websocket protocol's (``server.hub.wire``: an upgrade
request websockets refuses is answered there) and the app's (the token check, the welcome:
``server.hub.session``). ``BoundedHttp`` subclasses uvicorn's httptools protocol, which is not uvicorn's
public API: ``RELIED_ON`` names what it takes from it, ``check_uvicorn`` (below) refuses to start
on a uvicorn without it, and the tests in ``tests/test_hostile.py`` pin the behaviour.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
import re
import secrets
import textwrap
from dataclasses import dataclass
from http import HTTPStatus
from importlib import metadata
from types import CodeType, FunctionType
from typing import Any, ClassVar

import httptools
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from server import errors
from server.settings import Settings


def answer(status: int, code: str, message: str) -> bytes:
    """A complete HTTP/1.1 answer carrying the API's JSON error, after which the connection closes. It names
    its request as every answer does (``X-Request-Id``, and ``request_id`` in the error: ``httpkit``'s
    ``EveryAnswer``), with an id made here: the request never reached the app, whole or at all."""
    rid = secrets.token_hex(8)
    body = json.dumps({"error": {"code": code, "message": message, "request_id": rid}}).encode()
    head = (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nx-request-id: {rid}\r\nx-content-type-options: nosniff\r\n"
        "cache-control: no-store\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


def _timeout() -> bytes:
    return answer(408, errors.REQUEST_TIMEOUT, "the request did not arrive whole in time")


SERVICE_PREFIX = b"/api/service/"
# After a refusal, what the peer still sends is read and dropped for this long, or up to this much.
LINGER_SECONDS = 2.0
LINGER_BYTES = 1024 * 1024


@dataclass(frozen=True)
class HttpLimits:
    """What one HTTP request may carry (docs/configuration.md names each)."""

    head_bytes: int  # request line and headers together
    headers: int
    body_bytes: int
    service_body_bytes: int  # /api/service/*

    @classmethod
    def of(cls, settings: Settings) -> HttpLimits:
        return cls(
            settings.max_head_bytes,
            settings.max_headers,
            settings.max_body_bytes,
            settings.max_service_body_bytes,
        )


class _Refused(Exception):
    """Raised in a parser callback: the request is answered with ``answer`` and the connection closed."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer


class BoundedHttp(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol; a request must arrive whole within ``deadline_seconds``, and stay
    within ``limits``."""

    deadline_seconds: ClassVar[float] = 10.0
    limits: ClassVar[HttpLimits] = HttpLimits.of(Settings())

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._in_head = True  # the current request's line and headers are still arriving
        self._head_bytes = 0
        self._header_count = 0
        self._head_parsed = 0  # the request line and headers parsed so far, in bytes
        self._body_bytes = 0
        self._body_limit = self.limits.body_bytes
        self._lingering = False
        self._lingered = 0
        self._target = b""  # the request's target, as parsed (on_url may come in pieces)
        self._length: bytes | None = None  # its Content-Length

    def data_received(self, data: bytes) -> None:
        if self._lingering:  # refused: what the peer still sends is read and dropped, within a bound
            self._lingered += len(data)
            if self._lingered > LINGER_BYTES:
                self.transport.abort()
            return
        if self._in_head:
            self._head_bytes += len(data)
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as e:
            if not isinstance(e.__context__, _Refused):
                raise
            self._refuse(e.__context__.answer)
            return
        except httptools.HttpParserError:  # the HTTP API's JSON error, like every other refusal here
            self._refuse(answer(400, errors.BAD_REQUEST, "the request is not valid HTTP/1.1"))
            return
        except httptools.HttpParserUpgrade as upgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
                # What came after the request in the same read (httptools says where it ends) is the
                # websocket's: frames a client sent before the 101. uvicorn's own handler drops them.
                rest = data[upgrade.args[0] :] if upgrade.args else b""
                if rest:
                    self.transport.get_protocol().data_received(rest)  # type: ignore[attr-defined]
            else:
                self._unsupported_upgrade_warning()
            return
        if self._in_head and self._head_bytes > self.limits.head_bytes:
            message = f"the request line and headers are over {self.limits.head_bytes} bytes"
            self._refuse(answer(431, errors.REQUEST_TOO_LARGE, message))

    def _refuse(self, answer: bytes) -> None:
        """Answer, read no more requests, and close once the peer stops sending (within ``LINGER_*``):
        closing on bytes still unread would reset the connection, and the answer with it."""
        self._disarm()
        self._lingering = True
        self.transport.write(answer)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.transport.resume_reading()  # (flow control may have paused it for a body)
        asyncio.get_running_loop().call_later(LINGER_SECONDS, self._close)

    def _close(self) -> None:
        if not self.transport.is_closing():
            self.transport.close()

    def _stop(self, status: int, message: str) -> None:
        """From a parser callback: stop parsing; the request is answered and the connection closed."""
        raise _Refused(answer(status, errors.REQUEST_TOO_LARGE, message))

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._header_count, self._body_bytes, self._head_parsed = True, 0, 0, 0
        self._target, self._length = b"", None

    def on_url(self, url: bytes) -> None:
        self._head_parsed += len(url)
        self._target += url
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self.limits.headers:
            self._stop(431, f"more than {self.limits.headers} headers")
        # Counted as parsed too: a whole head that came in one read is never past the bound unseen.
        self._head_parsed += len(name) + len(value) + 4
        if self._head_parsed > self.limits.head_bytes:
            self._stop(431, f"the request line and headers are over {self.limits.head_bytes} bytes")
        if name.lower() == b"content-length":
            self._length = value
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head, self._head_bytes = False, 0
        service = self._target.startswith(SERVICE_PREFIX)
        self._body_limit = self.limits.service_body_bytes if service else self.limits.body_bytes
        length = self._length
        if length is not None and length.isdigit() and int(length) > self._body_limit:
            self._stop(413, f"the body is over {self._body_limit} bytes")
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        if self._body_bytes > self._body_limit:  # a chunked body: stopped as it grows
            self._stop(413, f"the body is over {self._body_limit} bytes")
        super().on_body(body)

    # (uvicorn's own signature names the base asyncio.BaseTransport; it is always a Transport here.)
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()
        self._in_head, self._head_bytes = True, 0  # the next request's head

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()  # the next request on this connection

    def handle_websocket_upgrade(self) -> None:
        self._disarm()  # the websocket protocol takes the connection over
        super().handle_websocket_upgrade()
        # This protocol is done with: its parser holds it (for its callbacks) and it holds the parser, a
        # cycle only a full collection would free — never, under the gc policy, while the hub is busy.
        self.parser = None  # type: ignore[assignment]

    def _arm(self) -> None:
        self._disarm()
        self._deadline = asyncio.get_running_loop().call_later(self.deadline_seconds, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            # Waiting for a request that has not arrived whole: answer, then close.
            self.transport.write(_timeout())
            self.transport.close()
        elif cycle.more_body:
            self.transport.abort()  # a body still trickling in while the app waits for it
        else:
            self._arm()  # the app is answering a complete request: not ours to cut


# What ``BoundedHttp`` reads, calls or overrides of uvicorn's httptools protocol: checked at start-up by
# ``check_uvicorn`` (below).
RELIED_ON: dict[type, tuple[str, ...]] = {
    HttpToolsProtocol: (
        "parser",
        "transport",
        "cycle",
        "_unset_keepalive_if_required",
        "_should_upgrade",
        "_unsupported_upgrade_warning",
        "handle_websocket_upgrade",
        "data_received",
        "connection_made",
        "connection_lost",
        "on_message_begin",
        "on_url",
        "on_header",
        "on_headers_complete",
        "on_body",
        "on_message_complete",
        "on_response_complete",
    ),
    RequestResponseCycle: ("response_complete", "more_body"),
}


def bounded_http(deadline_seconds: float, limits: HttpLimits | None = None) -> type[BoundedHttp]:
    """The HTTP protocol class to give uvicorn (``http=``)."""
    return type(
        "BoundedHttp",
        (BoundedHttp,),
        {"deadline_seconds": deadline_seconds, "limits": limits or BoundedHttp.limits},
    )


# The uvicorn versions the HTTP side was tested with, from the first on; a newer one is taken if
# ``check_uvicorn`` finds every name ``RELIED_ON`` lists. pyproject.toml says the same.
UVICORN_FROM = (0, 54)


class UnsupportedUvicorn(RuntimeError):
    """The installed uvicorn is older than the hub's HTTP side was tested with, or lacks something it uses:
    the hub does not start. The message is one line."""


def check_uvicorn() -> None:
    """Raise ``UnsupportedUvicorn`` unless the installed uvicorn is at least ``UVICORN_FROM`` and its HTTP
    protocol classes have every name ``server.hub.handshake.RELIED_ON`` lists: an attribute of the class or
    of a base, or one a method of theirs assigns to ``self`` (read from their source as installed)."""
    version = uvicorn.__version__
    tested = f"uvicorn>={UVICORN_FROM[0]}.{UVICORN_FROM[1]}"
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None or (int(found[1]), int(found[2])) < UVICORN_FROM:
        raise UnsupportedUvicorn(
            f"uvicorn {version} is installed, but the hub's HTTP side needs {tested}"
            " (server/hub/handshake.py): install a newer one"
        )
    for cls, names in RELIED_ON.items():
        missing = _missing(cls, names)
        if missing:
            installed = f"uvicorn {version}, websockets {metadata.version('websockets')}"
            raise UnsupportedUvicorn(
                f"{cls.__module__}.{cls.__qualname__} has no {', '.join(missing)}, which"
                f" server/hub/handshake.py uses ({installed}; tested from {tested})"
            )


def _missing(cls: type, names: tuple[str, ...]) -> list[str]:
    """Those of ``names`` that ``cls`` and its bases neither define nor assign to ``self`` in a method."""
    wanted = set(names) - {name for klass in cls.__mro__ for name in vars(klass)}
    for klass in cls.__mro__:
        for method in vars(klass).values():
            # Only the methods whose code names one still wanted are parsed (the check runs at every start).
            if wanted and inspect.isfunction(method) and wanted & _names_in(method.__code__):
                wanted -= _assigned_to_self(method)
    return sorted(wanted)


def _names_in(code: CodeType) -> set[str]:
    """The attribute and global names a function's code (and the code nested in it) uses."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, CodeType):
            names |= _names_in(const)
    return names


def _assigned_to_self(method: FunctionType) -> set[str]:
    """The attributes a method assigns to ``self``, read from its source as installed."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(method)))
    except (OSError, TypeError, SyntaxError):
        return set()  # no source to read (a compiled or generated method): not found there
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Store)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    }
