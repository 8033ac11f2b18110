"""Bounded handshakes: uvicorn's HTTP and websocket protocols with two holes closed.

- **A request must arrive whole in time.** uvicorn waits for the first request of a connection (and for
  the next one after a response) for as long as the peer likes: a client that connects and sends
  nothing, or trickles its headers, holds a file descriptor forever (a hub has ~20,000). Here it gets
  ``408 Request Timeout`` and the connection is closed ``handshake_seconds`` after it opened (or after the
  previous response), unless its request or upgrade has arrived whole by then.
- **An oversized upgrade request is answered.** websockets refuses a request line or header over 8 KB
  (or more than 128 headers) and prepares an answer (414 / 431), but uvicorn's websockets-sansio
  protocol never writes it and never closes the socket. Here it is answered and the socket closed.

Both answers carry the HTTP API's JSON error (``request_timeout``, ``request_too_large``).

What happens after the upgrade (the token check, the welcome) is bounded by the app itself
(``server.hub.session``). These classes subclass uvicorn's own (``uvicorn.protocols``); the tests in
``tests/test_hostile.py`` pin the behaviour, so an upgrade of uvicorn that moves it fails there.
"""

from __future__ import annotations

import asyncio
import json
from http import HTTPStatus
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.exceptions import SecurityError

from server import errors


def _answer(status: int, code: str, message: str) -> bytes:
    """A complete HTTP/1.1 answer carrying the API's JSON error, after which the connection closes."""
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    head = (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


_TIMEOUT = _answer(408, errors.REQUEST_TIMEOUT, "the request did not arrive whole in time")


class BoundedHttp(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol; a request must arrive whole within ``deadline_seconds``."""

    deadline_seconds: ClassVar[float] = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()

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


def bounded_protocols(deadline_seconds: float) -> tuple[type[BoundedHttp], type[BoundedWebSocket]]:
    """The HTTP and websocket protocol classes to give uvicorn (``http=``, ``ws=``)."""
    http = type("BoundedHttp", (BoundedHttp,), {"deadline_seconds": deadline_seconds})
    return http, BoundedWebSocket
