"""The hub's websockets below ASGI: frames in by callback, frames out straight to the transport.

Through ASGI every frame costs a trip through a queue and a task switch each way, and uvicorn pauses and
resumes reading the socket around every message. The hub's sockets skip that: ``HubWebSocket`` (the
protocol class ``redpacket serve`` gives uvicorn) hands each complete message to the session's
``on_message`` as it is parsed, and the hub writes each outgoing frame to the transport itself:

- a server frame is never masked, so with no extension negotiated (compression off, the default) the
  bytes of an event are the same for every socket and are framed once per fan-out (``data_frame``);
- ``writable`` says whether the transport takes more now; when it does not (the peer reads slowly and
  the kernel buffer is full) the caller keeps the frame and ``on_writable`` says when to go on.

The handshake, pings, the close handshake and parsing stay uvicorn's and websockets'. The end of the
socket (closed by the client, lost, timed out, or the server shutting down) is told to the listener
too (``on_gone``), so the endpoint waits on one future, not on a task reading ASGI messages.

**Why uvicorn is pinned.** ``HubWebSocket`` subclasses uvicorn's websockets-sansio protocol and reads its
private state (``queue``, ``frames``, ``curr_msg_data_type``, ``read_paused``…), which any uvicorn release
may change. The direct path is what makes the hub fast — measured in docs/benchmarks.md: hub CPU per ping
42 → 25–31 µs when frames left ASGI, and 32.2 → 27.2 KB per idle connection once uvicorn's receive queue
and the handshake's request and response are let go. So pyproject.toml pins the uvicorn versions this was
tested with (``UVICORN_TESTED``), and ``check_uvicorn`` — run where the hub builds its uvicorn
configuration — refuses, in one line, any other version or one whose classes lack what ``RELIED_ON`` here
and in ``server.hub.handshake`` names (read from the installed uvicorn and websockets, not from the
version string alone). websockets' public Sans-I/O ``ServerProtocol`` under an asyncio protocol of our own
could replace uvicorn's class and the pin; that was not measured here.
"""

from __future__ import annotations

import ast
import inspect
import re
import struct
import textwrap
from importlib import metadata
from types import CodeType, FunctionType
from typing import Any, Protocol, cast

import uvicorn
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.frames import Opcode
from websockets.server import ServerProtocol

from server.hub import handshake
from server.hub.handshake import BoundedWebSocket, HttpLimits, bounded_protocols
from server.settings import Settings

# The scope extension under which the endpoint finds its socket's protocol object.
EXTENSION = "redpacket.wire"

# The uvicorn versions the hub's protocol classes were tested with: from the first, up to (not
# including) the second. pyproject.toml pins the same range.
UVICORN_TESTED = ((0, 54), (0, 55))


class Listener(Protocol):
    def on_message(self, data: bytes | str) -> None: ...

    def on_writable(self) -> None: ...

    def on_gone(self) -> None: ...


def data_frame(payload: bytes | str) -> bytes:
    """A whole, unmasked server data frame: binary for bytes, text for str (RFC 6455 section 5.2)."""
    if isinstance(payload, str):
        body, first = payload.encode(), 0x80 | Opcode.TEXT
    else:
        body, first = payload, 0x80 | Opcode.BINARY
    n = len(body)
    if n < 126:
        return struct.pack("!BB", first, n) + body
    if n < 65536:
        return struct.pack("!BBH", first, 126, n) + body
    return struct.pack("!BBQ", first, 127, n) + body


class _Unread:
    """uvicorn's ASGI receive queue once the hub listens to a socket directly: what uvicorn still puts
    there (a disconnect) is heard through ``Listener.on_gone`` instead."""

    def put_nowait(self, message: object) -> None:
        pass

    def empty(self) -> bool:
        return True

    async def get(self) -> object:
        raise RuntimeError("a hub socket is read by server.hub.wire, not through ASGI receive")


class HubWebSocket(BoundedWebSocket):
    """uvicorn's websockets-sansio protocol (with bounded handshakes) and a direct path for data."""

    listener: Listener | None = None
    _reading_held = False

    def handle_connect(self, event: Any) -> None:
        super().handle_connect(event)
        scope = cast(dict[str, Any], getattr(self, "scope", None))
        if scope is not None:
            scope.setdefault("extensions", {})[EXTENSION] = self

    def listen(self, listener: Listener) -> None:
        """From now on every message goes to ``listener.on_message``; those that came before, waiting
        for the app's ``receive``, are handed over first, in order."""
        self.listener = listener
        waiting = self.queue
        # From here the ASGI side hears nothing more (the end comes through ``on_gone``): uvicorn's
        # queue and the handshake's request and response are let go (a few KB a socket).
        # (uvicorn's private attributes, typed for what uvicorn puts there: check_uvicorn pins them.)
        self.queue = _Unread()  # type: ignore[assignment]
        self.request = self.response = None  # type: ignore[assignment]
        while not waiting.empty():
            message = waiting.get_nowait()
            if message["type"] == "websocket.receive":
                data = message.get("bytes")
                listener.on_message(data if data is not None else message.get("text") or "")
        if self.read_paused:
            self.read_paused = False
            self.transport.resume_reading()

    def send_receive_event_to_app(self) -> None:
        listener = self.listener
        if listener is None:
            super().send_receive_event_to_app()
            return
        data = self.frames[0] if len(self.frames) == 1 else b"".join(self.frames)
        self.frames = []
        if self.close_sent:
            return
        if self.curr_msg_data_type == "text":
            try:
                listener.on_message(data.decode())
            except UnicodeDecodeError:
                self.conn.send_close(1007)
                self.handle_parser_exception()
        else:
            listener.on_message(data)

    # -- incoming flow control: the session holds reading while it has too many requests waiting ----

    def hold_reading(self) -> None:
        if not self._reading_held and not self.transport.is_closing():
            self._reading_held = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._reading_held:
            self._reading_held = False
            if not self.transport.is_closing():
                self.transport.resume_reading()

    # -- outgoing ------------------------------------------------------------------------------------

    @property
    def writable_now(self) -> bool:
        """Open, and the transport's buffer below its high-water mark."""
        return (
            self.writable.is_set()
            and not self.close_sent
            and not self.disconnected
            and not self.transport.is_closing()
        )

    @property
    def plain(self) -> bool:
        """No extension negotiated: one framing of a payload serves every such socket."""
        return not self.conn.extensions

    def frame(self, payload: bytes | str) -> bytes:
        """The bytes on the wire of one data message to this socket."""
        if self.plain:
            return data_frame(payload)
        if isinstance(payload, str):
            self.conn.send_text(payload.encode())
        else:
            self.conn.send_binary(payload)
        return b"".join(self.conn.data_to_send())

    def write(self, raw: bytes) -> None:
        """Write framed bytes (``frame``, or ``data_frame`` on a plain socket). The caller checked
        ``writable_now``; a transport that closed in between drops them."""
        self.transport.write(raw)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self.listener is not None:
            self.listener.on_writable()

    # -- the end: every way uvicorn tells the app the socket is done also tells the listener ----------

    def _gone(self) -> None:
        if self.listener is not None:
            self.listener.on_gone()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._gone()

    def handle_close(self, event: Any) -> None:
        super().handle_close(event)
        self._gone()

    def handle_parser_exception(self) -> None:
        super().handle_parser_exception()
        self._gone()

    def keepalive_timeout(self) -> None:
        super().keepalive_timeout()
        self._gone()

    def shutdown(self) -> None:
        super().shutdown()
        self._gone()


# What ``HubWebSocket`` reads, calls or overrides of uvicorn's websockets-sansio protocol, and of the
# websockets connection it holds as ``conn`` (``server.hub.handshake.RELIED_ON`` has the handshake's).
RELIED_ON: dict[type, tuple[str, ...]] = {
    WebSocketsSansIOProtocol: (
        "queue",
        "frames",
        "curr_msg_data_type",
        "read_paused",
        "close_sent",
        "disconnected",
        "writable",
        "transport",
        "conn",
        "scope",
        "request",
        "response",
        "handle_connect",
        "send_receive_event_to_app",
        "resume_writing",
        "connection_lost",
        "handle_close",
        "handle_parser_exception",
        "keepalive_timeout",
        "shutdown",
    ),
    ServerProtocol: ("extensions", "send_text", "send_binary", "send_close", "data_to_send"),
}


class UnsupportedUvicorn(RuntimeError):
    """The installed uvicorn is not one the hub's protocol classes were tested with, or lacks something
    they use: the hub does not start. The message is one line."""


def check_uvicorn() -> None:
    """Raise ``UnsupportedUvicorn`` unless the installed uvicorn is in ``UVICORN_TESTED`` and its classes
    (and websockets') have every name ``RELIED_ON`` lists, here and in ``server.hub.handshake``: an
    attribute of the class or of a base, or one a method of theirs assigns to ``self`` (read from their
    source as installed)."""
    (low, high), version = UVICORN_TESTED, uvicorn.__version__
    tested = f"uvicorn>={low[0]}.{low[1]},<{high[0]}.{high[1]}"
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None or not low <= (int(found[1]), int(found[2])) < high:
        raise UnsupportedUvicorn(
            f"uvicorn {version} is installed, but the hub's websockets were tested with {tested}"
            " only (server/hub/wire.py): install that range"
        )
    for relied_on, where in ((handshake.RELIED_ON, "handshake.py"), (RELIED_ON, "wire.py")):
        for cls, names in relied_on.items():
            missing = _missing(cls, names)
            if missing:
                installed = f"uvicorn {version}, websockets {metadata.version('websockets')}"
                raise UnsupportedUvicorn(
                    f"{cls.__module__}.{cls.__qualname__} has no {', '.join(missing)}, which"
                    f" server/hub/{where} uses ({installed}; tested with {tested})"
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


def uvicorn_config(app: object, settings: Settings) -> uvicorn.Config:
    """How the hub runs under uvicorn: websockets-sansio with bounded handshakes (``server.hub.handshake``),
    no compression unless asked, frame cap, pings. Raises ``UnsupportedUvicorn`` first if the installed
    uvicorn is not one they were tested with (``check_uvicorn``)."""
    check_uvicorn()
    http, _ = bounded_protocols(settings.handshake_seconds, HttpLimits.of(settings))
    return uvicorn.Config(
        # (uvicorn.Config types app as its ASGI protocol; Starlette's app is one, typed otherwise.)
        app,  # type: ignore[arg-type]
        http=http,
        ws=HubWebSocket,  # bounded handshakes, and the hub's frames below ASGI
        ws_per_message_deflate=settings.ws_compression,
        ws_max_size=settings.ws_max_frame_bytes,
        ws_ping_interval=settings.ws_ping_interval,
        ws_ping_timeout=settings.ws_ping_timeout,
        timeout_graceful_shutdown=settings.shutdown_seconds,
        log_level="warning",
        access_log=False,
    )
