"""Bounded handshakes: uvicorn's HTTP and websocket protocols with two holes closed.

- **A request must arrive whole in time.** uvicorn waits for the first request of a connection (and for
  the next one after a response) for as long as the peer likes: a client that connects and sends
  nothing, or trickles its headers, holds a file descriptor forever (a hub has ~20,000). Here it gets
  ``408 Request Timeout`` and the connection is closed ``handshake_seconds`` after it opened (or after the
  previous response), unless its request or upgrade has arrived whole by then.
- **A request is bounded before the app sees it** (``HttpLimits``): its request line and headers together
  (``431``, checked as the bytes arrive, so an endless header is never held whole), the number of its
  headers (``431``), its body — by ``Content-Length`` before anything is read (``413``), and as it arrives
  when chunked. The chat backend's routes (``/api/service/``) take larger bodies than a user's.
- **An oversized upgrade request is answered.** websockets refuses a request line or header over 8 KB
  (or more than 128 headers) and prepares an answer (414 / 431), but uvicorn's websockets-sansio
  protocol never writes it and never closes the socket. Here it is answered and the socket closed.

Every answer carries the HTTP API's JSON error (``request_timeout``, ``request_too_large``).

What happens after the upgrade (the token check, the welcome) is bounded by the app itself
(``server.hub.session``). These classes subclass uvicorn's own (``uvicorn.protocols``), which are not its
public API: ``RELIED_ON`` names what they take from them, ``server.hub.wire.check_uvicorn`` refuses to
start on a uvicorn without it or outside the tested versions (pyproject.toml pins the same range), and
the tests in ``tests/test_hostile.py`` pin the behaviour.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, ClassVar

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.exceptions import SecurityError
from websockets.server import ServerProtocol

from server import errors
from server.settings import Settings


def _answer(status: int, code: str, message: str) -> bytes:
    """A complete HTTP/1.1 answer carrying the API's JSON error, after which the connection closes."""
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    head = (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


_TIMEOUT = _answer(408, errors.REQUEST_TIMEOUT, "the request did not arrive whole in time")
SERVICE_PREFIX = b"/api/service/"
# After a refusal, what the peer still sends is read and dropped for this long, or up to this much.
LINGER_SECONDS = 2.0
LINGER_BYTES = 1024 * 1024


@dataclass(frozen=True)
class HttpLimits:
    """What one HTTP request may carry (the README's settings table names each)."""

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
            self._refuse(_answer(400, errors.BAD_REQUEST, "the request is not valid HTTP/1.1"))
            return
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        if self._in_head and self._head_bytes > self.limits.head_bytes:
            message = f"the request line and headers are over {self.limits.head_bytes} bytes"
            self._refuse(_answer(431, errors.REQUEST_TOO_LARGE, message))

    def _refuse(self, answer: bytes) -> None:
        """Answer, read no more requests, and close once the peer stops sending (within ``LINGER_*``):
        closing on bytes still unread would reset the connection, and the answer with it."""
        self._disarm()
        self._lingering = True
        self.transport.write(answer)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.transport.resume_reading()  # (flow control may have paused it for a body)
        self.loop.call_later(LINGER_SECONDS, self._close)

    def _close(self) -> None:
        if not self.transport.is_closing():
            self.transport.close()

    def _stop(self, status: int, message: str) -> None:
        """From a parser callback: stop parsing; the request is answered and the connection closed."""
        raise _Refused(_answer(status, errors.REQUEST_TOO_LARGE, message))

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._header_count, self._body_bytes, self._head_parsed = True, 0, 0, 0

    def on_url(self, url: bytes) -> None:
        self._head_parsed += len(url)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self.limits.headers:
            self._stop(431, f"more than {self.limits.headers} headers")
        # Counted as parsed too: a whole head that came in one read is never past the bound unseen.
        self._head_parsed += len(name) + len(value) + 4
        if self._head_parsed > self.limits.head_bytes:
            self._stop(431, f"the request line and headers are over {self.limits.head_bytes} bytes")
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head, self._head_bytes = False, 0
        service = self.url.startswith(SERVICE_PREFIX)
        self._body_limit = self.limits.service_body_bytes if service else self.limits.body_bytes
        for name, value in self.headers:
            if name == b"content-length" and value.isdigit() and int(value) > self._body_limit:
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

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.deadline_seconds, self._expired)

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
            self.transport.write(_TIMEOUT)
            self.transport.close()
        elif cycle.more_body:
            self.transport.abort()  # a body still trickling in while the app waits for it
        else:
            self._arm()  # the app is answering a complete request: not ours to cut


class BoundedWebSocket(WebSocketsSansIOProtocol):
    """uvicorn's websockets-sansio protocol that answers a refused upgrade request and closes."""

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.handshake_initiated or self.conn.handshake_exc is None or self.transport.is_closing():
            return
        # websockets refused an oversized request line (414) or headers (431), or could not parse it (400).
        prepared = b"".join(self.conn.data_to_send())
        refused = self.conn.handshake_exc
        if isinstance(refused, SecurityError):
            status = int(prepared.split(b" ", 2)[1]) if prepared.startswith(b"HTTP/1.1 4") else 431
            answer = _answer(status, errors.REQUEST_TOO_LARGE, "the request line or headers are too large")
        else:
            answer = _answer(400, errors.BAD_REQUEST, "not a valid websocket upgrade request")
        self.transport.write(answer)
        self.transport.close()


# What the classes above read, call or override of uvicorn's protocols (and of the websockets connection
# uvicorn's websocket protocol holds as ``conn``): checked at start-up by ``server.hub.wire.check_uvicorn``.
RELIED_ON: dict[type, tuple[str, ...]] = {
    HttpToolsProtocol: (
        "parser",
        "transport",
        "loop",
        "cycle",
        "url",
        "headers",
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
    WebSocketsSansIOProtocol: ("data_received", "handshake_initiated", "conn", "transport"),
    ServerProtocol: ("handshake_exc", "data_to_send"),
}


def bounded_protocols(
    deadline_seconds: float, limits: HttpLimits | None = None
) -> tuple[type[BoundedHttp], type[BoundedWebSocket]]:
    """The HTTP and websocket protocol classes to give uvicorn (``http=``, ``ws=``)."""
    http = type(
        "BoundedHttp",
        (BoundedHttp,),
        {"deadline_seconds": deadline_seconds, "limits": limits or BoundedHttp.limits},
    )
    return http, BoundedWebSocket
