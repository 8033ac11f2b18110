"""The hub's websockets: its own asyncio protocol over websockets' public Sans-I/O ``ServerProtocol``,
given to uvicorn as ``ws=`` (its public seam). The upgrade, the app and the keepalive are
``server.hub.upgrade``'s; once the socket is open every byte is this module's:

- **Frames in by callback.** Once the endpoint calls ``listen``, each message goes straight to
  ``Listener.on_message`` as it is parsed: no ASGI queue, no task switch. A whole message frame is
  unmasked here, every other frame is websockets' to parse (``server.hub.frames``).
- **Frames out straight to the transport.** A server frame is never masked: with no extension (no
  compression, the default) an event is framed once per fan-out (``data_frame``). ``writable_now`` says
  whether the transport takes more; if not, the caller keeps the frame until ``Listener.on_writable``.
- **Every frame counted.** Ping, pong, close and continuation frames (what the request limit does not
  see) count against ``frames_per_second``: past it, closed 1008 ``frame_flood``. Every byte read counts
  against ``bytes_per_second``: past it, the socket is not read until its second is over.
- **One socket never stalls the rest.** A turn parses at most ``TURN_BYTES`` (and stops past
  ``TURN_FRAMES`` frames); the rest waits for a later turn (``call_soon``: after the other sockets read in
  the same loop iteration): a flood of 6-byte pings read back to back under uvloop held a hub for seconds.
- **Flow control.** While the transport's write buffer is above its high-water mark the socket is not
  read, so the pongs websockets queues for each ping never pile up; reading resumes below the low mark.
- **A close always ends.** However it closes, the TCP connection is aborted if not gone ``close_seconds``
  later: a peer that never reads cannot keep a closed socket's buffers. ``lost`` resolves when the
  transport is really gone (the endpoint keeps the user's socket slot until then).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Any, ClassVar, Protocol, cast

from websockets.frames import Frame, Opcode
from websockets.http11 import Request
from websockets.protocol import SEND_EOF

from server.hub.frames import Kind, data_frame, next_frame, unmask
from server.hub.protocol import CLOSE_FLOOD
from server.hub.upgrade import EARLY_MESSAGES, Hold, Upgrade

log = logging.getLogger(__name__)


# One turn of parsing: at most this many bytes are given to the parser, a chunk at a time, and no more
# chunk once this many frames came out (the rest of what was read waits for the next turn). A chunk of
# 6-byte frames is ~340 of them: ~2-3 ms of websockets' parsing.
TURN_BYTES = 8192
CHUNK_BYTES = 2048
TURN_FRAMES = 64
# The phases in which what is read is parsed (after them it is read and dropped).
READING = ("handshake", "deciding", "open")
# A message may come in at most this many frames (more: closed 1009, as a message over the size limit).
MAX_FRAGMENTS = 64
# After the end, what the peer still sends is read and dropped up to this much (then the connection is cut).
LINGER_BYTES = 1024 * 1024
# The frames the request limit does not see, and so are counted here.
CONTROL = (Opcode.PING, Opcode.PONG, Opcode.CLOSE, Opcode.CONT)


class Listener(Protocol):
    def on_message(self, data: bytes | str) -> None: ...

    def on_writable(self) -> None: ...

    def on_gone(self) -> None: ...


class HubWebSocket(Upgrade):
    """One websocket of the hub, from the upgrade request to the transport's end (the module's docstring).
    Its budgets and timeouts are class attributes, set from the settings (``server.hub.app``)."""

    # Told of each limit hit (``frames``, ``bytes``), from the upgrade on (the hub's metrics).
    on_limited: ClassVar[Callable[[str], None]] = staticmethod(lambda limit: None)
    frames_per_second: ClassVar[int] = 50
    bytes_per_second: ClassVar[int] = 1 << 20

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # (what uvicorn gives a ws= class: Upgrade's arguments)
        self.listener: Listener | None = None
        self._parts = bytearray()  # the message being assembled
        self._fragments = 0
        self.frames_in = 0  # frames parsed on this socket
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
        self._partial = bytearray()  # the start of a frame not all read yet
        self._needed = 0  # the bytes that frame takes, once its header is read (else 0)
        self._delimiting = True  # False once a frame could not be delimited: all bytes go to websockets

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
        for the app's ``receive``, are handed over first, in order. (Gone already: nothing is.)"""
        if self.phase == "gone":
            return  # (the session would only hold this protocol, and it the session, for nothing)
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
        # What refers back to this protocol goes (the session, the scope's extension): the socket's
        # objects are freed now by reference counting, not left to a full collection (gcpolicy).
        self.listener, self.scope = None, {}

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

    # -- reading: turns, budgets, holds ---------------------------------------------------------------

    def _parse_turn(self, data: bytes) -> None:
        """Parse at most ``TURN_BYTES`` of ``data``, in ``CHUNK_BYTES`` pieces, stopping past ``TURN_FRAMES``
        frames (the frames of one piece are all handled); keep the rest for a later turn. Once the socket
        ends, nothing more is parsed: the rest is dropped."""
        at = frames = 0
        while at < len(data) and at < TURN_BYTES and frames < TURN_FRAMES and not self._holds:
            if self.phase not in READING:
                break
            # (the upgrade request, bounded by the HTTP side's head limit, goes to websockets whole: a part
            # of it left for a later turn would come back with the frames sent behind it)
            chunk = data[at:] if self.phase == "handshake" else data[at : at + CHUNK_BYTES]
            at += len(chunk)
            frames += self._parse(chunk)
        rest = data[at:]
        if not rest or self.phase == "gone":
            return
        if self.phase not in READING:
            self._lingered += len(rest)  # ended meanwhile: dropped
            return
        self._backlog = rest + self._backlog
        self._sync_reading()
        if not self._holds:
            self._next_turn_soon()

    def _next_turn_soon(self) -> None:
        if self._turn is None:
            self._turn = self.loop.call_soon(self._next_turn)

    def _next_turn(self) -> None:
        self._turn = None
        if self._holds or self.phase not in READING:
            return
        data, self._backlog = self._backlog, b""
        self._parse_turn(data)
        self._sync_reading()

    def _parse(self, chunk: bytes) -> int:
        """Act on the frames ``chunk`` completes (``server.hub.frames``): a whole message is unmasked here,
        any other frame goes to websockets whole; the number of frames. A part of a frame waits for the
        rest. The upgrade request is websockets' alone: uvicorn hands it over rebuilt, with nothing after it
        (what followed it in the same read comes next, ``BoundedHttp``, and waits for the socket to open)."""
        if self.phase == "handshake" or not self._delimiting:
            return self._websockets(chunk)
        buf: bytes | bytearray = chunk
        if self._partial:  # (kept in a bytearray: a large frame read in many pieces is copied once)
            self._partial += chunk
            if len(self._partial) < self._needed:
                return 0
            buf, self._partial = self._partial, bytearray()
        at = frames = 0
        limit, ours = self.config.ws_max_size, self.phase == "open" and self.plain
        while self.phase in READING:
            kind, start, end = next_frame(buf, at, limit)
            if kind is Kind.PARTIAL:
                self._partial, self._needed = bytearray(buf[at:]), end - at
                break
            if kind is Kind.TOO_LARGE:  # websockets reads its header and fails the socket (1009)
                self._delimiting = False
                return frames + self._websockets(bytes(buf[at:]))
            if ours and kind is not Kind.OTHER and not self._fragments:
                self.frames_in += 1
                self._text = kind is Kind.TEXT
                self._message(unmask(buf, start, end))
            else:  # (written at once: a pong, or the close that ends a socket websockets failed)
                self._websockets(bytes(buf[at:end]))
            frames += 1
            at = end
        if self.phase not in READING:
            self._partial = bytearray()
        return frames

    def _websockets(self, chunk: bytes) -> int:
        """Give ``chunk`` to websockets' parser and act on what came out; the number of frames."""
        self.conn.receive_data(chunk)
        frames = 0
        for event in self.conn.events_received():
            if isinstance(event, Request):
                self._on_request(event)
                continue
            if not isinstance(event, Frame):
                continue  # (a Response: what a client parses, never a server)
            frames += 1
            self.frames_in += 1
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
        if self._frames > self.frames_per_second and self.phase in ("open", "deciding"):
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
        if self.phase not in READING:
            return
        match frame.opcode:
            case Opcode.TEXT | Opcode.BINARY:
                self._text = frame.opcode is Opcode.TEXT
                if frame.fin:
                    self._message(bytes(frame.data))
                else:
                    self._parts, self._fragments = bytearray(frame.data), 1
            case Opcode.CONT:
                # (websockets caps the message's size, not its fragments: empty ones would be free.)
                self._parts += frame.data
                self._fragments += 1
                if self._fragments > MAX_FRAGMENTS:
                    self.close(1009, "too many fragments")
                elif frame.fin:
                    data, self._parts, self._fragments = bytes(self._parts), bytearray(), 0
                    self._message(data)
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

    def _message(self, data: bytes) -> None:
        if self.phase not in ("open", "deciding"):
            return  # closing: what the client still sends is dropped (before the accept: kept, early)
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
        Only while open: before the 101 (a client that pings before it) and once ended, frames are dropped."""
        for data in self.conn.data_to_send():
            if data is SEND_EOF or data == b"":
                self._end()
            elif self.phase == "open" and not self.transport.is_closing():
                self.transport.write(data)

    def _reading_ended(self) -> None:
        """Nothing more is parsed: the turn due, the budget's timer, what waits and every hold go."""
        for handle in (self._turn, self._budget_timer):
            if handle is not None:
                handle.cancel()
        self._turn = self._budget_timer = None
        self._backlog, self._partial = b"", bytearray()
        self._holds.clear()

    def _gone(self) -> None:
        if self.listener is not None:
            self.listener.on_gone()

    def _limited(self, limit: str) -> None:
        type(self).on_limited(limit)
