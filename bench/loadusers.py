"""The users of ``redpacket load``: members and admins speaking the hub's protocol (msgpack over a
websocket), one socket each. ``bench/locustfile.py`` (what Locust loads) imports them.

Every request is timed as Locust's ``request`` event: the type is the request (``connect``, ``sync``,
``grab``, ``open``, ``send``, ``chat``, ``presence``), the name its outcome (a grab's ``won``, ``already``,
``empty``, ``expired``, or the error code; for the others ``ok`` or the error code). An error code other
than a grab's normal outcomes is a failure. The packets a member saw are counted apart, as ``offered``.
"""

from __future__ import annotations

import itertools
import json
import random
import time
import urllib.request
from typing import Any, ClassVar

import gevent
import msgpack
import websocket
from gevent.event import AsyncResult
from locust import User, between, events, task
from locust.env import Environment
from locust.runners import WorkerRunner

from bench.loadplan import server_frames

SUBPROTOCOL = "redpacket.v1.msgpack"
# Only replies and "packet" events are decoded (msgpack fixstr of "reply" / "packet"); the rest of a
# room's events (grabs, presence, chat) are read and dropped.
WANTED_REPLY, WANTED_EVENT = b"\xa5reply", b"\xa6packet"
GRAB_OUTCOMES = {"won", "already", "packet_empty", "packet_expired"}
NAMES = {"packet_empty": "empty", "packet_expired": "expired"}
# The "request type" under which the members count the packets they saw: the grabs the load offered.
OFFERED = "offered"


class Fixture:
    """The run's users (tokens) and groups, as ``redpacket load`` wrote them."""

    members: ClassVar[list[dict[str, Any]]] = []
    groups: ClassVar[list[dict[str, Any]]] = []
    topup: ClassVar[bool] = False

    @classmethod
    def load(cls, path: str) -> None:
        with open(path) as f:
            data = json.load(f)
        cls.members = [m for m in data["users"] if m.get("role") != "admin"]
        cls.groups = data["groups"]
        cls.topup = bool(data.get("topup"))


def _stride(environment: Environment) -> tuple[int, int]:
    """(this process's index, how many processes share the identities)."""
    runner = environment.runner
    if isinstance(runner, WorkerRunner):
        options = environment.parsed_options
        return max(0, runner.worker_index), max(1, int(getattr(options, "expect_workers", 1) or 1))
    return 0, 1


class HubSocket:
    """One websocket to the hub: requests matched to replies by id, events handed to a callback."""

    def __init__(self, user: User, url: str, token: str, on_event: Any) -> None:
        self.user = user
        self.pending: dict[int, AsyncResult] = {}
        self.ids = itertools.count(1)
        self.on_event = on_event
        self.closed = False
        self.ws = websocket.create_connection(
            f"{url}?token={token}", subprotocols=[SUBPROTOCOL], timeout=30, enable_multithread=True
        )
        self.welcome = self._decode(self.ws.recv())
        if self.welcome.get("type") != "welcome":
            raise RuntimeError(f"no welcome: {self.welcome}")
        # From here frames are read off the socket in large chunks and parsed here (websocket-client's
        # reader costs several socket calls and a timer per frame: the load would measure itself).
        assert self.ws.sock is not None
        self.ws.sock.settimeout(None)
        self.buffer = bytearray(b"".join(self.ws.frame_buffer.recv_buffer))
        self.reader = gevent.spawn(self._read)

    @staticmethod
    def _decode(frame: bytes | str) -> dict[str, Any]:
        if isinstance(frame, str):
            return dict(json.loads(frame))
        return dict(msgpack.unpackb(frame, raw=False))

    def _read(self) -> None:
        sock = self.ws.sock
        assert sock is not None
        try:
            while True:
                chunk = sock.recv(262144)
                if not chunk:
                    raise ConnectionError("closed by the hub")
                self.buffer += chunk
                frames, used = server_frames(self.buffer)
                del self.buffer[:used]
                for opcode, payload in frames:
                    if opcode == 0x9:  # ping
                        self.ws.pong(payload)
                    elif opcode == 0x8:
                        raise ConnectionError(f"closed by the hub: {payload[:2].hex()}")
                    elif WANTED_REPLY in payload or WANTED_EVENT in payload:
                        self._dispatch(self._decode(payload))
        except Exception as e:
            self.closed = True
            for waiting in self.pending.values():
                waiting.set_exception(ConnectionError(f"socket closed: {e}"))
            self.pending.clear()

    def _dispatch(self, message: dict[str, Any]) -> None:
        kind = message.get("type")
        if kind == "reply":
            waiting = self.pending.pop(message.get("id") or 0, None)
            if waiting is not None:
                waiting.set(message)
        elif kind == "event":
            self.on_event(message)

    def request(self, kind: str, /, **fields: Any) -> tuple[dict[str, Any], float]:
        """Send a request; its reply and how long it took (ms)."""
        rid = next(self.ids)
        waiting = self.pending[rid] = AsyncResult()
        started = time.perf_counter()
        self.ws.send_binary(msgpack.packb({"id": rid, "type": kind, **fields}, use_bin_type=True))
        reply: dict[str, Any] = waiting.get(timeout=30)
        return reply, (time.perf_counter() - started) * 1000

    def close(self) -> None:
        self.closed = True
        try:
            self.ws.close()
        except Exception:
            pass
        self.reader.kill(block=False)


class HubError(Exception):
    """An error reply (the code is the message)."""


class Connected(User):
    """A user holding one socket to the hub, reconnecting (and syncing) when it drops."""

    abstract = True
    identity: dict[str, Any]
    socket: HubSocket | None = None
    stopping = False

    def ws_url(self) -> str:
        host = self.host or ""
        return host.replace("http://", "ws://", 1).replace("https://", "wss://", 1).rstrip("/") + "/ws"

    def fire(self, kind: str, name: str, ms: float, error: str | None = None) -> None:
        self.environment.events.request.fire(
            request_type=kind,
            name=name,
            response_time=ms,
            response_length=0,
            exception=HubError(error) if error else None,
            context={},
        )

    def ask(self, kind: str, /, **fields: Any) -> tuple[dict[str, Any], float] | None:
        """Send a request: its reply and how long it took (ms); None when there is no socket, or it
        closed or timed out under the request (recorded as a failure named ``closed``)."""
        socket = self.ensure_socket()
        if socket is None:
            return None
        try:
            return socket.request(kind, **fields)
        except (ConnectionError, gevent.Timeout, OSError, websocket.WebSocketException) as e:
            self.fire(kind, "closed", 30000.0 if isinstance(e, gevent.Timeout) else 0.0, type(e).__name__)
            return None

    def call(self, kind: str, name: str | None = None, /, **fields: Any) -> dict[str, Any] | None:
        """A timed request: its data, or None after an error reply (recorded as a failure)."""
        answered = self.ask(kind, **fields)
        if answered is None:
            return None
        reply, ms = answered
        if reply.get("ok"):
            self.fire(kind, name or "ok", ms)
            return dict(reply["data"])
        code = str(reply["error"]["code"])
        self.fire(kind, code, ms, code)
        return None

    def ensure_socket(self) -> HubSocket | None:
        if self.socket is not None and not self.socket.closed:
            return self.socket
        if self.stopping:
            return None  # the run is over for this user: no reconnect
        started = time.perf_counter()
        try:
            self.socket = HubSocket(self, self.ws_url(), self.identity["token"], self.on_event)
        except Exception as e:
            self.fire("connect", "ws", (time.perf_counter() - started) * 1000, f"{type(e).__name__}: {e}")
            self.socket = None
            gevent.sleep(1.0)  # the hub refused or is away: try again on the next task, not at once
            return None
        self.fire("connect", "ws", (time.perf_counter() - started) * 1000)
        self.call("sync", groups={str(g["group_id"]): None for g in self.socket.welcome["groups"]})
        return self.socket

    def on_event(self, message: dict[str, Any]) -> None:
        pass

    def on_stop(self) -> None:
        self.stopping = True
        if self.socket is not None:
            self.socket.close()


_members = itertools.count()
_admins = itertools.count()


class Member(Connected):
    """A member: online in its group, grabs each packet that appears after a human reaction time (one
    grab per packet, within the grab limit), opens it to see the list, chats now and then."""

    weight = 1
    wait_time = between(15, 45)

    def on_start(self) -> None:
        index, stride = _stride(self.environment)
        members = Fixture.members
        self.identity = members[(next(_members) * stride + index) % len(members)]
        self.grab_times: list[float] = []
        self.reacting: set[gevent.Greenlet] = set()  # grabs not yet made (a person about to tap)
        self.asking: set[gevent.Greenlet] = set()  # grabs sent, waiting for their reply
        self.ensure_socket()

    def on_event(self, message: dict[str, Any]) -> None:
        if message.get("event") == "packet" and not self.stopping:
            data = message["data"]
            if data.get("target") not in (None, self.identity["user_id"]):
                return
            # A grab offered: counted apart from requests (the knee compares served with offered).
            # (Locust's event hooks are not annotated: pyproject lets the locustfile alone call them.)
            events.request.fire(  # type: ignore[no-untyped-call]
                request_type=OFFERED, name="packet", response_time=0, response_length=0, exception=None
            )
            grabbing = gevent.spawn(self.grab, int(message["group"]), int(data["packet_id"]))
            self.reacting.add(grabbing)
            grabbing.link(self.reacting.discard)
            grabbing.link(self.asking.discard)

    def on_stop(self) -> None:
        # Grabs still waiting out their reaction time when the run stops are not made; grabs sent get
        # their reply counted (every "won" the hub said is in the report, to compare with the ledger).
        self.stopping = True
        gevent.killall(list(self.reacting), block=False)
        gevent.joinall(list(self.asking), timeout=30)
        super().on_stop()

    def reaction(self) -> float:
        median = self.environment.parsed_options.reaction_ms / 1000
        return float(min(5.0, max(0.15, random.lognormvariate(0, 0.5) * median)))

    def grab(self, group: int, packet: int) -> None:
        gevent.sleep(self.reaction())
        if self.stopping:
            return
        # The grab limit (5 a second per user and group, bursts of 10): a human does not tap faster.
        now = time.monotonic()
        self.grab_times = [t for t in self.grab_times if now - t < 2.0]
        if len(self.grab_times) >= 10:
            return
        self.grab_times.append(now)
        current = gevent.getcurrent()
        self.reacting.discard(current)
        self.asking.add(current)
        answered = self.ask("grab", group=group, packet=packet)
        if answered is None:
            return
        reply, ms = answered
        if reply.get("ok"):
            self.fire("grab", str(reply["data"]["outcome"]), ms)
        else:
            code = str(reply["error"]["code"])
            self.fire("grab", NAMES.get(code, code), ms, None if code in GRAB_OUTCOMES else code)
        self.call("open", group=group, packet=packet)

    @task
    def chat(self) -> None:
        every = self.environment.parsed_options.chat_every
        if every <= 0 or random.random() > 30.0 / every:
            return
        socket = self.ensure_socket()
        if socket is None or not socket.welcome["groups"]:
            return
        group = random.choice(socket.welcome["groups"])["group_id"]
        self.call("chat", group=group, text=random.choice(["恭喜发财", "thanks!", "🧧", "again!"]))


class Admin(Connected):
    """A group's admin: about every ``--send-every`` seconds (never all admins at once) a lucky or an
    equal packet into the group, shared among about as many as are online (none while fewer than two)."""

    fixed_count = 1  # set to the number of groups at init
    wait_time = between(5, 15)

    def on_start(self) -> None:
        index, stride = _stride(self.environment)
        groups = Fixture.groups
        self.room = groups[(next(_admins) * stride + index) % len(groups)]
        self.identity = self.room["admin"]
        self.sent = 0
        self.ensure_socket()
        gevent.sleep(random.uniform(0, self.environment.parsed_options.send_every))  # not all at once

    @task
    def send(self) -> None:
        group_id = int(self.room["group_id"])
        online = self.call("presence", group=group_id)
        if online is None or len(online["online"]) < 2:
            return
        members = len(online["online"]) - 1
        count = max(1, min(100, round(members * random.uniform(0.5, 1.0))))
        self.sent += 1
        kind = "equal" if self.sent % 2 == 0 else "lucky"
        per = random.randint(20, 199)
        total = min(20000 // count * count, count * per)
        fields = {"group": group_id, "kind": kind, "total": total, "count": count, "greeting": "恭喜发财"}
        answered = self.ask("send", **fields)
        if answered is None:
            return
        reply, ms = answered
        if reply.get("ok"):
            self.fire("send", kind, ms)
            return
        code = str(reply["error"]["code"])
        self.fire("send", code, ms, code)
        if code == "insufficient_funds" and Fixture.topup:
            top_up(self.host or "", self.identity["token"], f"load-{time.time_ns()}")


def top_up(host: str, token: str, request_id: str, amount: int = 100_000_000) -> None:
    body = json.dumps({"amount": amount, "request_id": request_id}).encode()
    req = urllib.request.Request(
        f"{host.rstrip('/')}/api/topup", data=body, headers={"authorization": f"Bearer {token}"}
    )
    with urllib.request.urlopen(req, timeout=30):
        pass
