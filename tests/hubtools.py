"""Running real hubs for tests: in this process (uvicorn on a random port, in the test's loop) or as
separate ``redpacket serve`` processes; logging in and calling the HTTP API; a room (a group, its admin
and members) made through it and the events a client gets; waiting with deadlines. (The fixtures ``h``,
a hub in this process, and ``service_hub``, one that takes the chat backend's key: ``tests/conftest.py``.)"""

from __future__ import annotations

import asyncio
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx
import uvicorn
from starlette.applications import Starlette

from redpacket_client.connection import HubClient
from server.core import Core
from server.hub.app import create_app, uvicorn_config
from server.hub.hub import Hub
from server.settings import Settings, child_env
from worker.main import beside_hub


class _Server(uvicorn.Server):
    """A uvicorn server that says when it is listening."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.listening = asyncio.Event()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self.listening.set()


@dataclass
class HubUnderTest:
    http: str
    settings: Settings
    app: Starlette | None = None
    process: subprocess.Popen[str] | None = None

    @property
    def ws(self) -> str:
        return self.http.replace("http://", "ws://") + "/ws"

    @property
    def hub(self) -> Hub:
        assert self.app is not None
        return self.app.state.hub  # type: ignore[no-any-return]

    @property
    def core(self) -> Core:
        assert self.app is not None
        return self.app.state.core  # type: ignore[no-any-return]

    async def api(self, method: str, path: str, token: str | None = None, **body: Any) -> Any:
        headers = {"authorization": f"Bearer {token}"} if token else {}
        async with httpx.AsyncClient(base_url=self.http, timeout=30) as http:
            r = await http.request(method, path, json=body or None, headers=headers)
        return r.json()

    async def login(self, name: str) -> tuple[int, str]:
        data = await self.api("POST", "/api/login", name=name)
        return int(data["user_id"]), str(data["token"])

    async def client(self, token: str, fmt: str = "msgpack", sync: bool = True, **options: Any) -> HubClient:
        c = await HubClient.connect(self.ws, token, fmt, **options)  # type: ignore[arg-type]
        if sync:
            await c.sync()
        return c


@dataclass
class Room:
    """A group made through a hub's API: its admin (with money) and members, each with a token."""

    group: int
    admin: int
    admin_token: str
    members: list[tuple[int, str]]


async def make_room(h: HubUnderTest, members: int, prefix: str = "m") -> Room:
    """An admin topped up with 1,000,000 cents, ``members`` more users, and a group of them all, made
    through ``h``'s API (user names start with ``prefix``)."""
    admin, token = await h.login(f"{prefix}admin")
    await h.api("POST", "/api/topup", token, amount=1_000_000, request_id="seed")
    group = (await h.api("POST", "/api/groups", token, name="family"))["group_id"]
    people = [await h.login(f"{prefix}{i}") for i in range(members)]
    if people:
        await h.api("POST", f"/api/groups/{group}/members", token, user_ids=[u for u, _ in people])
    return Room(group, admin, token, people)


async def events_of(c: HubClient, n: int, kind: str | None = None) -> list[dict[str, Any]]:
    """The first ``n`` group events ``c`` gets (of ``kind`` only, when given), each within 30 s."""
    got: list[dict[str, Any]] = []
    while len(got) < n:
        ev = await c.next_event()
        if kind is None or ev.get("event") == kind:
            got.append(ev)
    return got


def free_port() -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# Below the kernel's ephemeral range (/proc/sys/net/ipv4/ip_local_port_range: 32768-60999 by default),
# so that no outgoing connection is given one as its local port.
SERVER_PORTS = range(20_000, 32_768)
_given: set[int] = set()


def server_port() -> int:
    """A port for a server a test stops and starts again on the same port (a Redis node, its cluster
    bus): free now, never given before in this process, and outside the ephemeral range — a port from
    ``free_port`` can be taken meanwhile by any outgoing connection's local end."""
    while True:
        port = random.choice(SERVER_PORTS)
        if port in _given:
            continue
        _given.add(port)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


def _bound_socket(port: int = 0) -> socket.socket:
    # IPPROTO_TCP: asyncio sets TCP_NODELAY on accepted sockets only when the listener says TCP.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    return sock


@asynccontextmanager
async def hub_in_process(
    settings: Settings, run_worker: bool = False, port: int = 0
) -> AsyncIterator[HubUnderTest]:
    """A hub in this process; with ``run_worker``, a credit worker beside it as under ``redpacket up``; on
    ``port`` when given (a hub stopped and started again where its clients knew it)."""
    app = create_app(settings, beside=beside_hub if run_worker else None)
    sock = _bound_socket(port)
    server = _Server(uvicorn_config(app, settings))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    listening = asyncio.create_task(server.listening.wait())
    await asyncio.wait({task, listening}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        await task
    try:
        yield HubUnderTest(f"http://127.0.0.1:{sock.getsockname()[1]}", settings, app=app)
    finally:
        listening.cancel()
        server.should_exit = True
        await asyncio.wait_for(task, 30)


def hub_url(output: IO[str]) -> str:
    """The address a starting ``redpacket up`` / ``serve`` prints; fails with all it printed if none."""
    seen: list[str] = []
    for line in iter(output.readline, ""):
        seen.append(line)
        m = re.search(r"redpacket hub on (http://\S+)", line)
        if m:
            return m.group(1)
    raise AssertionError("the hub did not start:\n" + "".join(seen))


def hub_env(settings: Settings) -> dict[str, str]:
    return child_env(
        REDPACKET_REDIS_URL=settings.redis_url,
        REDPACKET_DATABASE_URL=settings.database_url,
        REDPACKET_SECRET=settings.secret,
        REDPACKET_DEV_LOGIN=str(int(settings.dev_login)),
        REDPACKET_DEMO_TOPUP=str(int(settings.demo_topup)),
        REDPACKET_QUEUE_NAME=settings.queue_name,
        REDPACKET_QUEUE_REDIS_URL=settings.queue_redis_url,
        REDPACKET_GRAB_DURABILITY=settings.grab_durability,
        REDPACKET_SHUTDOWN_SECONDS="10",
    )


def worker_env(settings: Settings, metrics_port: int = 0) -> dict[str, str]:
    """The environment of a ``redpacket worker`` process on ``settings`` (metrics off unless a port)."""
    return child_env(
        REDPACKET_REDIS_URL=settings.redis_url,
        REDPACKET_QUEUE_REDIS_URL=settings.queue_redis_url,
        REDPACKET_DATABASE_URL=settings.database_url,
        REDPACKET_QUEUE_NAME=settings.queue_name,
        REDPACKET_GRAB_DURABILITY=settings.grab_durability,
        REDPACKET_WORKER_METRICS_PORT=str(metrics_port),
    )


@asynccontextmanager
async def hub_process(
    settings: Settings, *args: str, env: dict[str, str] | None = None
) -> AsyncIterator[HubUnderTest]:
    """``redpacket serve`` (with ``args``, and ``env`` over ``hub_env``) as its own process."""
    proc = subprocess.Popen(  # noqa: ASYNC220 - started once per test, not on a hot path
        [sys.executable, "-m", "server", "serve", "--port", "0", *args],
        env={**hub_env(settings), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    url = await asyncio.to_thread(hub_url, proc.stdout)
    drain = asyncio.create_task(asyncio.to_thread(proc.stdout.read))
    try:
        yield HubUnderTest(url, settings, process=proc)
    finally:
        if proc.poll() is None:
            proc.terminate()
        await asyncio.to_thread(proc.wait, 30)
        output = await drain
        proc.stdout.close()
        # Shown by pytest when the test fails: what the hub said.
        print(f"--- hub {url} (exit {proc.returncode}) ---\n{output[-5000:]}")


@contextmanager
def redpacket_up(
    data_dir: Path, *args: str, env: dict[str, str] | None = None, said: list[str] | None = None
) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """``redpacket up --port 0`` on ``data_dir`` as a newcomer runs it (with ``env`` set): (its address,
    the process). Its output is drained (into ``said``, its lines as they come) so it never blocks on a
    full pipe; stopped with SIGINT (Ctrl-C) unless already gone."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "server", "up", "--port", "0", *args],
        env=child_env(REDPACKET_DATA_DIR=str(data_dir), **(env or {})),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    url = hub_url(proc.stdout)
    said = [] if said is None else said
    drain = threading.Thread(target=lambda: said.extend(iter(proc.stdout.readline, "")), daemon=True)  # type: ignore[union-attr]
    drain.start()
    try:
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            proc.kill()  # not left running into the next test; what it said (stacks included) is shown
            proc.wait(timeout=30)
            drain.join(timeout=30)
            proc.stdout.close()
            text = "".join(said)
            at = text.find("still running while stopping")  # one line per task: first, whole
            raise AssertionError(
                "redpacket up did not stop on Ctrl-C; where its tasks waited:\n"
                + (text[at : at + 6000] if at >= 0 else "(not said)")
                + "\n--- the end of what it said:\n"
                + text[-12000:]
            ) from None
        drain.join(timeout=30)
        proc.stdout.close()


async def eventually(check: Callable[[], Awaitable[bool] | bool], timeout: float = 30.0) -> None:
    """Wait until ``check()`` is true, polling briefly; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)
