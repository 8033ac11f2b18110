"""The hub's websockets: its own asyncio protocol over websockets' public Sans-I/O ``ServerProtocol``,
given to uvicorn as ``ws=`` (its public seam). The upgrade, the app and the keepalive are
``server.hub.upgrade``'s; once the socket is open every byte is this module's:

- **Frames in by callback.** Once the endpoint calls ``listen``, each message goes straight to
  ``Listener.on_message`` as it is parsed: no ASGI queue, no task switch.
- **Frames out straight to the transport.** A server frame is never masked: with no extension (no
  compression, the default) an event is framed once per fan-out (``data_frame``). ``writable_now`` says
  whether the transport takes more; if not, the caller keeps the frame until ``Listener.on_writable``.
- **Every frame counted.** Ping, pong, close and continuation frames (what the request limit does not
  see) count against ``frames_per_second``: past it, closed 1008 ``frame_flood``. Every byte read counts
  against ``bytes_per_second``: past it, the socket is not read until its second is over.
- **One socket never stalls the rest.** A turn parses at most ``TURN_BYTES`` (and stops past
  ``TURN_FRAMES`` frames); the rest waits for a later turn (``call_soon``: after the other sockets read in
  the same loop iteration). websockets parses in pure Python, ~5-10 µs a frame: a flood of 6-byte pings
  read back to back under uvloop held a hub for seconds.
- **Flow control.** While the transport's write buffer is above its high-water mark the socket is not
  read, so the pongs websockets queues for each ping never pile up; reading resumes below the low mark.
- **A close always ends.** However it closes, the TCP connection is aborted if not gone ``close_seconds``
  later: a peer that never reads cannot keep a closed socket's buffers. ``lost`` resolves when the
  transport is really gone (the endpoint keeps the user's socket slot until then).
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections import deque
from typing import Any, ClassVar, Protocol, cast

import uvicorn
from uvicorn.server import ServerState
from websockets.exceptions import InvalidState
from websockets.frames import Frame, Opcode
from websockets.http11 import Request
from websockets.protocol import SEND_EOF

from server.hub.protocol import CLOSE_FLOOD
from server.hub.upgrade import EARLY_MESSAGES, Hold, Upgrade

log = logging.getLogger(__name__)


# One turn of parsing: at most this many bytes are given to the parser, and no more once this many
# frames came out (the rest of what was read waits for the next turn).
TURN_BYTES = 2048
TURN_FRAMES = 64
# After the end, what the peer still sends is read and dropped up to this much (then the connection is cut).
LINGER_BYTES = 1024 * 1024
# The frames the request limit does not see, and so are counted here.
CONTROL = (Opcode.PING, Opcode.PONG, Opcode.CLOSE, Opcode.CONT)


class Listener(Protocol):
    def on_message(self, data: bytes | str) -> None: ...

    def on_writable(self) -> None: ...

    def on_gone(self) -> None: ...

    def on_limited(self, limit: str) -> None: ...


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


class HubWebSocket(Upgrade):
    """One websocket of the hub, from the upgrade request to the transport's end (the module's docstring).
    Its budgets and timeouts are class attributes, set from the settings (``server.hub.app``)."""

    frames_per_second: ClassVar[int] = 50
    bytes_per_second: ClassVar[int] = 1 << 20
    close_seconds: ClassVar[float] = 2.0

    def __init__(
        self,
        config: uvicorn.Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.listener: Listener | None = None
        self._parts: list[bytes] = []  # the message being assembled
        self._text = False
        self._holds: set[Hold] = set()
        self._read_paused = False
        self._backlog = b""  # read and not parsed yet
        self._turn: asyncio.Handle | None = None
        self._window = 0.0  # when the current second of the budgets began
        self._frames = 0
        self._bytes = 0
        self._budget_timer: asyncio.TimerHandle | None = None
        self._writes_paused = False
        self._close_timer: asyncio.TimerHandle | None = None
        self._lingered = 0

    # -- what the hub's connection and session use ------------------------------------------------------

    @property
    def close_sent(self) -> bool:
        """The socket is closing or gone: nothing more is sent on it."""
        return self.phase in ("closing", "gone")

    @property
    def disconnected(self) -> bool:
        return self.phase == "gone"

    @property
    def writable_now(self) -> bool:
        """Open, and the transport's buffer below its high-water mark."""
        return self.phase == "open" and not self._writes_paused and not self.transport.is_closing()

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

    def listen(self, listener: Listener) -> None:
        """From now on every message goes to ``listener.on_message``; those that came before, waiting
        for the app's ``receive``, are handed over first, in order."""
        self.listener = listener
        early, self._inbox = self._inbox, deque()
        for message in early:
            if message["type"] == "websocket.receive":
                data = message.get("bytes")
                listener.on_message(data if data is not None else message.get("text") or "")
            else:
                self._inbox.append(message)  # (a disconnect: the app's receive still hears it)
        self._release("early")

    @property
    def held_for(self) -> frozenset[str]:
        """Why the socket is not read now (empty: it is): ``session``, ``early``, ``budget``, ``writes``,
        ``turn``."""
        return frozenset(self._holds)

    def hold_reading(self) -> None:
        """The session has too many requests waiting: read no more until ``resume_reading``."""
        self._hold("session")

    def resume_reading(self) -> None:
        self._release("session")

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

    # -- asyncio.Protocol -----------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.connections.add(self)
        self._window = self.loop.time()

    def connection_lost(self, exc: Exception | None) -> None:
        was = self.phase
        self.phase = "gone"
        self.connections.discard(self)
        self._stop_keepalive()
        for timer in (self._close_timer, self._budget_timer, self._turn):
            if timer is not None:
                timer.cancel()
        self._backlog = b""
        self._deliver({"type": "websocket.disconnect", "code": 1005 if was != "handshake" else 1006})
        if not self.lost.done():
            self.lost.set_result(None)
        self._gone()

    def eof_received(self) -> bool | None:
        if self.phase != "closing":
            self.conn.receive_eof()
            self._flush()
        return None  # the transport closes itself

    def pause_writing(self) -> None:
        self._writes_paused = True
        self._hold("writes")

    def resume_writing(self) -> None:
        self._writes_paused = False
        self._release("writes")
        if self.listener is not None and self.phase == "open":
            self.listener.on_writable()

    def data_received(self, data: bytes) -> None:
        if self.phase == "gone":
            return
        if self.phase == "closing":  # ended (``_end``): read and dropped, within a bound
            self._lingered += len(data)
            if self._lingered > LINGER_BYTES:
                self.transport.abort()
            return
        self._spend(0, len(data))
        if self._backlog or self._holds:
            # (a read that came before a pause took effect, or while a turn is due: after what waits)
            self._backlog += data
            self._sync_reading()
            return
        self._parse_turn(data)

    def shutdown(self) -> None:
        """The server is stopping (uvicorn calls this on every connection)."""
        if self.phase == "open":
            self.close(1012)
        elif self.phase != "gone":
            if self.phase == "deciding" and self._response is not None:
                self._respond(self.conn.reject(500, "Internal Server Error"))
            self._end()

    # -- reading: turns, budgets, holds ---------------------------------------------------------------

    def _parse_turn(self, data: bytes) -> None:
        """Parse at most ``TURN_BYTES`` of ``data`` (stopping early past ``TURN_FRAMES`` frames); keep the
        rest for a later turn."""
        frames = 0
        while data and frames < TURN_FRAMES and not self._holds and self.phase != "gone":
            chunk, data = data[:TURN_BYTES], data[TURN_BYTES:]
            frames += self._parse(chunk)
            if frames == 0 and len(chunk) == TURN_BYTES:
                break  # (a large frame arriving: one chunk a turn keeps every turn short)
        if data and self.phase != "gone":
            self._backlog = data + self._backlog
            self._sync_reading()
            if not self._holds:
                self._next_turn_soon()

    def _next_turn_soon(self) -> None:
        if self._turn is None:
            self._turn = self.loop.call_soon(self._next_turn)

    def _next_turn(self) -> None:
        self._turn = None
        if self._holds or self.phase == "gone":
            return
        data, self._backlog = self._backlog, b""
        self._parse_turn(data)
        self._sync_reading()

    def _parse(self, chunk: bytes) -> int:
        """Give ``chunk`` to the parser and act on what came out; the number of frames."""
        self.conn.receive_data(chunk)
        frames = 0
        for event in self.conn.events_received():
            if isinstance(event, Request):
                self._on_request(event)
                continue
            if not isinstance(event, Frame):
                continue  # (a Response: what a client parses, never a server)
            frames += 1
            self._on_frame(event)
            if self.phase == "gone":
                return frames
        if self.phase == "handshake" and self.conn.handshake_exc is not None:
            self._refuse_upgrade()
            return frames
        if self.conn.parser_exc is not None and self.close_code is None:
            # websockets failed the connection (a frame too large: 1009, a protocol error: 1002): its
            # close frame and end of stream are written below.
            sent = self.conn.close_sent
            self.close_code = sent.code if sent is not None else 1002
        self._flush()
        return frames

    def _spend(self, frames: int, n: int) -> None:
        """Count ``frames`` frames and ``n`` bytes against this second's budgets, acting on an overrun."""
        now = self.loop.time()
        if now - self._window >= 1.0:
            self._window, self._frames, self._bytes = now, 0, 0
        self._frames += frames
        self._bytes += n
        if self._frames > self.frames_per_second and self.phase == "open":
            log.info("websocket closed: over %d control frames a second", self.frames_per_second)
            self._limited("frames")
            self.close(CLOSE_FLOOD, "frame_flood")
        elif self._bytes > self.bytes_per_second and "budget" not in self._holds:
            self._limited("bytes")
            self._hold("budget")  # read again when this second is over
            self._budget_timer = self.loop.call_at(self._window + 1.0, self._budget_renewed)

    def _budget_renewed(self) -> None:
        self._budget_timer = None
        self._window, self._frames, self._bytes = self.loop.time(), 0, 0
        self._release("budget")

    def _hold(self, why: Hold) -> None:
        self._holds.add(why)
        self._sync_reading()

    def _release(self, why: Hold) -> None:
        if why in self._holds:
            self._holds.discard(why)
            self._sync_reading()
            if not self._holds and self._backlog:
                self._next_turn_soon()

    def _sync_reading(self) -> None:
        """Pause the transport's reading while any hold or a backlog is there; resume it otherwise."""
        pause = bool(self._holds or self._backlog) and self.phase != "gone"
        if pause != self._read_paused and self.transport is not None and not self.transport.is_closing():
            self._read_paused = pause
            (self.transport.pause_reading if pause else self.transport.resume_reading)()

    # -- frames -----------------------------------------------------------------------------------------

    def _on_frame(self, frame: Frame) -> None:
        if frame.opcode in CONTROL:
            self._spend(1, 0)
        if self.phase == "gone":
            return
        match frame.opcode:
            case Opcode.TEXT | Opcode.BINARY:
                self._text = frame.opcode is Opcode.TEXT
                self._parts = [bytes(frame.data)]
                if frame.fin:
                    self._message()
            case Opcode.CONT:
                self._parts.append(bytes(frame.data))
                if frame.fin:
                    self._message()
            case Opcode.PING:
                pass  # websockets queued the pong; written by _flush (not while writes are held)
            case Opcode.PONG:
                self._on_pong(bytes(frame.data))
            case Opcode.CLOSE:  # websockets echoed it and marked the end of stream: written now
                received = self.conn.close_rcvd
                if self.close_code is None:
                    self.close_code = received.code if received is not None else 1005
                    self._deliver(
                        {
                            "type": "websocket.disconnect",
                            "code": self.close_code,
                            "reason": received.reason if received is not None else "",
                        }
                    )
                self._flush()
                self._end()

    def _message(self) -> None:
        data = self._parts[0] if len(self._parts) == 1 else b"".join(self._parts)
        self._parts = []
        if self.phase != "open":
            return  # closing: what the client still sends is dropped
        if self._text:
            try:
                text = data.decode()
            except UnicodeDecodeError:
                self.conn.fail(1007, "invalid UTF-8")
                self.close_code = 1007
                self._flush()
                self._end()
                return
            if self.listener is not None:
                self.listener.on_message(text)
            else:
                self._early({"type": "websocket.receive", "text": text})
        elif self.listener is not None:
            self.listener.on_message(data)
        else:
            self._early({"type": "websocket.receive", "bytes": data})

    def _early(self, message: dict[str, Any]) -> None:
        """A message before the endpoint listens: for the app's ``receive`` (or ``listen``)."""
        self._deliver(message)
        if len(self._inbox) >= EARLY_MESSAGES:
            self._hold("early")

    def _flush(self) -> None:
        """Write what websockets has to send (pongs, a close); its end-of-stream mark ends the connection.
        Once ended, nothing more is written (what websockets still has, a pong, is dropped)."""
        for data in self.conn.data_to_send():
            if self.phase in ("closing", "gone"):
                continue
            if data is SEND_EOF or data == b"":
                self._end()
            elif not self.transport.is_closing():
                self.transport.write(data)

    def _end(self) -> None:
        """End the TCP connection: our end of stream after what is buffered, then what the peer still sends
        is read and dropped (``LINGER_BYTES`` at most) until it closes its side — closing on unread bytes
        would reset the connection, and the close frame with it. Aborted if not gone ``close_seconds`` on
        (a peer that reads nothing, or never closes)."""
        if self.phase == "gone":
            return
        self.phase = "closing"
        self._stop_keepalive()
        for handle in (self._turn, self._budget_timer):
            if handle is not None:
                handle.cancel()
        self._turn = self._budget_timer = None
        self._backlog = b""
        self._holds.clear()
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

    def _gone(self) -> None:
        if self.listener is not None:
            self.listener.on_gone()

    def _limited(self, limit: str) -> None:
        if self.listener is not None:
            self.listener.on_limited(limit)
