"""A hub websocket's way in, its app and its way out: the upgrade request answered by websockets' Sans-I/O
``ServerProtocol`` (``accept``, ``reject``, ``send_response``), the ASGI scope, the app's ``receive`` and
``send`` (accept, refuse with 403, close, send; an app that fails closes 1011), the keepalive pings, and
the end (every close ends the TCP connection within ``close_seconds``). ``Upgrade`` is the base of the
hub's protocol (``server.hub.wire.HubWebSocket``), which adds what happens to frames once the socket is
open; the hooks at the end of the class are its.

An upgrade request websockets refuses (a line or header over 8 KB, more than 128 headers, an unreadable
one) is answered with the HTTP API's JSON error (414 / 431 ``request_too_large``, 400 ``bad_request``) and
the connection ended. Everything taken from uvicorn is what it hands every ``ws=`` class: its ``Config``
and ``ServerState``.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar, Literal, cast
from urllib.parse import unquote

import uvicorn
from uvicorn.server import ServerState
from websockets.exceptions import InvalidState, SecurityError
from websockets.extensions.permessage_deflate import ServerPerMessageDeflateFactory
from websockets.http11 import Request, Response
from websockets.server import ServerProtocol

from server import errors
from server.hub.handshake import answer

log = logging.getLogger(__name__)
# websockets' own lines: it says "connection open" at INFO for every socket (ten thousand a hub). Its
# warnings and errors still show.
websockets_log = logging.getLogger("server.hub.websockets")
websockets_log.setLevel(logging.WARNING)

# The scope extension under which the endpoint finds its socket's protocol object.
EXTENSION = "redpacket.wire"
# Messages parsed before the endpoint listens (the welcome is being made): past this many, the socket
# is not read until it listens.
EARLY_MESSAGES = 32

Phase = Literal["handshake", "deciding", "open", "closing", "gone"]
# Why the socket is not read now (it is read again when no reason is left).
Hold = Literal["session", "early", "budget", "writes", "turn", "deciding"]


def _address(info: Any) -> tuple[str, int] | None:
    return (str(info[0]), int(info[1])) if isinstance(info, tuple | list) and len(info) >= 2 else None


class Upgrade(asyncio.Protocol):
    """The upgrade, the app, the keepalive and the end of one websocket (the module's docstring)."""

    close_seconds: ClassVar[float] = 2.0

    def __init__(
        self,
        config: uvicorn.Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        if not config.loaded:
            config.load()
        self.config = config
        self.app: Callable[..., Awaitable[None]] = config.loaded_app
        self.loop = _loop or asyncio.get_event_loop()
        self.app_state = app_state
        self.connections: set[Any] = server_state.connections
        self.tasks = server_state.tasks
        self.default_headers = server_state.default_headers
        extensions = []
        if config.ws_per_message_deflate:
            extensions = [
                ServerPerMessageDeflateFactory(
                    server_max_window_bits=12, client_max_window_bits=12, compress_settings={"memLevel": 5}
                )
            ]
        self.conn = ServerProtocol(extensions=extensions, max_size=config.ws_max_size, logger=websockets_log)
        self.transport: asyncio.Transport = cast(asyncio.Transport, None)
        self.scope: dict[str, Any] = {}
        self.phase: Phase = "handshake"
        self.lost: asyncio.Future[None] = self.loop.create_future()
        self.close_code: int | None = None  # the code of the close this socket ended with, if any
        self._response: Response | None = None
        self._inbox: deque[dict[str, Any]] = deque()  # ASGI events the app has not received yet
        self._wakeup: asyncio.Future[None] | None = None
        self._ping_timer: asyncio.TimerHandle | None = None
        self._pong_timer: asyncio.TimerHandle | None = None
        self._ping_payload: bytes | None = None
        self._close_timer: asyncio.TimerHandle | None = None
        self._lingered = 0  # bytes read and dropped since the end

    # -- keepalive --------------------------------------------------------------------------------------

    def _start_keepalive(self) -> None:
        interval = self.config.ws_ping_interval
        if interval is not None and interval > 0:
            self._ping_timer = self.loop.call_later(interval, self._ping)

    def _stop_keepalive(self) -> None:
        for timer in (self._ping_timer, self._pong_timer):
            if timer is not None:
                timer.cancel()
        self._ping_timer = self._pong_timer = None
        self._ping_payload = None

    def _ping(self) -> None:
        self._ping_timer = None
        if self.phase != "open":
            return
        self._ping_payload = secrets.token_bytes(4)
        self.conn.send_ping(self._ping_payload)
        self._flush()
        timeout = self.config.ws_ping_timeout
        if timeout is not None:
            self._pong_timer = self.loop.call_later(timeout, self._no_pong)
        else:
            self._start_keepalive()

    def _on_pong(self, payload: bytes) -> None:
        if self._ping_payload is None or payload != self._ping_payload:
            return  # unsolicited, or an old one
        self._ping_payload = None
        if self._pong_timer is not None:
            self._pong_timer.cancel()
            self._pong_timer = None
            self._start_keepalive()

    def _no_pong(self) -> None:
        self._pong_timer = None
        if self.phase != "open":
            return
        self.conn.fail(1011, "keepalive ping timeout")
        self.close_code = 1011
        self._flush()
        self._end()

    # -- the handshake and ASGI ---------------------------------------------------------------------------

    def _on_request(self, request: Request) -> None:
        response = self.conn.accept(request)
        if response.status_code != 101:  # (no key, another version: websockets' own words say why)
            said = response.body.decode("utf-8", "replace").strip() or "not a valid websocket upgrade request"
            self._answer(answer(response.status_code, errors.BAD_REQUEST, said))
            return
        self._response = response
        self.phase = "deciding"
        raw_path, _, query = request.path.partition("?")
        root = self.config.root_path
        subprotocols = [
            token.strip()
            for header in request.headers.get_all("Sec-WebSocket-Protocol")
            for token in header.split(",")
        ]
        ssl = self.transport.get_extra_info("sslcontext") is not None
        self.scope = {
            "type": "websocket",
            "asgi": {"version": self.config.asgi_version, "spec_version": "2.4"},
            "http_version": "1.1",
            "scheme": "wss" if ssl else "ws",
            "server": _address(self.transport.get_extra_info("sockname")),
            "client": _address(self.transport.get_extra_info("peername")),
            "root_path": root,
            "path": root + unquote(raw_path),
            "raw_path": root.encode("ascii") + raw_path.encode("ascii"),
            "query_string": query.encode("ascii"),
            "headers": [
                (k.lower().encode("ascii"), v.encode("latin-1")) for k, v in request.headers.raw_items()
            ],
            "subprotocols": [p for p in subprotocols if p],
            "state": self.app_state.copy(),
            "extensions": {EXTENSION: self},
        }
        self._deliver({"type": "websocket.connect"})
        self._hold("deciding")  # (frames sent before the 101 wait for it)
        task = self.loop.create_task(self._run_app())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _refuse_upgrade(self) -> None:
        """websockets refused the upgrade request (too large: 414 / 431; unreadable: 400): answered with the
        HTTP API's JSON error, and closed."""
        prepared = b"".join(self.conn.data_to_send())
        if isinstance(self.conn.handshake_exc, SecurityError):
            status = int(prepared.split(b" ", 2)[1]) if prepared.startswith(b"HTTP/1.1 4") else 431
            reply = answer(status, errors.REQUEST_TOO_LARGE, "the request line or headers are too large")
        else:
            reply = answer(400, errors.BAD_REQUEST, "not a valid websocket upgrade request")
        self.transport.write(reply)
        self._end()

    def _answer(self, reply: bytes) -> None:
        """An HTTP answer instead of the upgrade (the API's JSON error, naming its request as every answer
        does: ``handshake.answer``), then the end."""
        if not self.transport.is_closing():
            self.transport.write(reply)
        self._end()

    async def _run_app(self) -> None:
        code = 1000  # the app returned with the socket open: closed normally
        try:
            await self.app(self.scope, self._receive, self._send)
        except asyncio.CancelledError:
            code = 1012  # the server is going away
            raise
        except Exception:
            log.exception("exception in the websocket endpoint")
            code = 1011
        finally:
            if self.phase == "open":
                self.close(code)
            elif self.phase == "deciding":
                self._answer(answer(500, errors.INTERNAL, "internal error"))

    def _deliver(self, message: dict[str, Any]) -> None:
        self._inbox.append(message)
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    async def _receive(self) -> dict[str, Any]:
        while not self._inbox:
            self._wakeup = self.loop.create_future()
            await self._wakeup
        message = self._inbox.popleft()
        if len(self._inbox) < EARLY_MESSAGES:
            self._release("early")
        return message

    async def _send(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if self.phase == "deciding":
            if kind == "websocket.accept":
                response = cast(Response, self._response)
                headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in self.default_headers]
                headers += [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])]
                if message.get("subprotocol"):
                    headers.append(("Sec-WebSocket-Protocol", message["subprotocol"]))
                del response.headers["Date"]
                response.headers.update(headers)
                self.conn.send_response(response)
                self.phase = "open"
                self._response = None
                self._flush()
                self._start_keepalive()
                self._release("deciding")
            elif kind == "websocket.close":  # refused before the upgrade: 403
                self._deliver({"type": "websocket.disconnect", "code": 1006})
                reason = str(message.get("reason") or "")
                code = reason if reason in errors.ALL_CODES else errors.ORIGIN_NOT_ALLOWED
                self._answer(answer(403, code, "the websocket was refused before it opened"))
            else:
                raise RuntimeError(f"expected websocket.accept or websocket.close, got {kind!r}")
        elif kind == "websocket.send":
            if self.phase == "open":
                data = message.get("bytes")
                self.write(self.frame(data if data is not None else message.get("text") or ""))
        elif kind == "websocket.close":
            self.close(int(message.get("code", 1000)), message.get("reason") or "")
        elif self.phase in ("closing", "gone"):
            pass  # (a send after the end: dropped, as the client is gone)
        else:
            raise RuntimeError(f"unexpected ASGI message {kind!r}")

    # -- the end ----------------------------------------------------------------------------------------

    def close(self, code: int, reason: str = "") -> None:
        """Send a close frame (if the socket is open) and end the TCP connection once it is written, or
        ``close_seconds`` from now at the latest (aborted then: a peer that does not read)."""
        if self.phase == "open":
            try:
                self.conn.send_close(code, reason)
            except InvalidState:
                pass
            self.close_code = code
            self._flush()
        # The TCP connection ends after the close frame, without waiting for the client's answer: what a
        # flooding or silent client would send meanwhile is never read.
        self._end()

    def shutdown(self) -> None:
        """The server is stopping (uvicorn calls this on every connection)."""
        if self.phase == "open":
            self.close(1012)
        elif self.phase != "gone":
            if self.phase == "deciding" and self._response is not None:
                self._answer(answer(500, errors.INTERNAL, "internal error"))
            self._end()

    def _end(self) -> None:
        """End the TCP connection: our end of stream after what is buffered, then what the peer still sends
        is read and dropped (``LINGER_BYTES`` at most) until it closes its side — closing on unread bytes
        would reset the connection, and the close frame with it. Aborted if not gone ``close_seconds`` on
        (a peer that reads nothing, or never closes)."""
        if self.phase == "gone":
            return
        self.phase = "closing"
        self._stop_keepalive()
        self._reading_ended()
        if not self.transport.is_closing():
            if self.transport.can_write_eof():
                self.transport.write_eof()
                self._sync_reading()  # (read again, to drop)
            else:
                self.transport.close()
        self._arm_close()
        self._gone()

    def _arm_close(self) -> None:
        if self._close_timer is None and self.phase != "gone":
            self._close_timer = self.loop.call_later(self.close_seconds, self.transport.abort)

    # -- what the socket's protocol provides ----------------------------------------------------------------

    def frame(self, payload: bytes | str) -> bytes:
        raise NotImplementedError

    def write(self, raw: bytes) -> None:
        raise NotImplementedError

    def _flush(self) -> None:
        raise NotImplementedError

    def _hold(self, why: Hold) -> None:
        raise NotImplementedError

    def _release(self, why: Hold) -> None:
        raise NotImplementedError

    def _sync_reading(self) -> None:
        raise NotImplementedError

    def _reading_ended(self) -> None:
        raise NotImplementedError

    def _gone(self) -> None:
        raise NotImplementedError
