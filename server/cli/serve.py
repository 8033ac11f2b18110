"""``redpacket up`` and ``redpacket serve``: the listening sockets, the banner, and one hub process or a
supervisor of several on one socket."""

from __future__ import annotations

import asyncio
import gc
import secrets
import socket
import sys
from types import FrameType

import uvicorn
import uvloop

from server import tracing
from server.cli.errors import OperatorError
from server.cli.services import check_services
from server.hub.app import uvicorn_config
from server.probe import ask_own, own_url
from server.settings import Settings, redact
from server.stopping import STOP_SECONDS, leave_within, say_where_stuck

_stop_requested = False


def on_sigterm(signum: int, frame: FrameType | None) -> None:
    """SIGTERM outside uvicorn's drain: exit cleanly. Remembered too: a SystemExit raised while a weakref
    callback runs (the import system's, during start-up) is printed and dropped, and the hub must then
    still not start serving."""
    global _stop_requested
    _stop_requested = True
    leave_within()  # (the way out, a loop's end included, is bounded)
    sys.exit(0)


class _Server(uvicorn.Server):
    """uvicorn's server; a stop that takes longer than the drain budget says where it is stuck: every
    task and every thread's stack on stderr (it keeps stopping meanwhile)."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            say_where_stuck((self.config.timeout_graceful_shutdown or 0) + STOP_SECONDS, then_exit=False)
        super().handle_exit(sig, frame)


def hub_healthy(settings: Settings) -> bool:
    """``serve --check``: the health of the hub listening on this host's ``REDPACKET_PORT`` (in a container:
    its own hub), as ``/healthz`` says it, in one line (the image's ``HEALTHCHECK``). The hub answers
    within a second whatever hangs behind it; 3 s leave the check's own start inside its 6 s."""
    url = own_url(settings.host, settings.port, "/healthz")
    try:
        status, said = ask_own(url, 3)
    except OSError as e:
        print(f"unhealthy: no hub answers on {url} ({e})")
        return False
    ok = status == 200
    print(f"{'healthy' if ok else 'unhealthy'}: {url} answered {status} {said[:200]}")
    return ok


def demo_secret(settings: Settings) -> Settings:
    """`up` is the embedded demo: a secret kept under the data dir (dev login and top-ups are on:
    ``server.cli``'s settings)."""
    if settings.secret:
        return settings
    path = settings.data_dir / "secret"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(secrets.token_hex(32))
        path.chmod(0o600)
    return settings.replace(secret=path.read_text().strip())


def listen(settings: Settings) -> socket.socket:
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY on accepted sockets only when the listening
    # socket says so; without it every reply behind an event waits out a 40 ms delayed ACK.
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((settings.host, settings.port))
    except OSError as e:
        sock.close()
        raise OperatorError(
            f"cannot listen on {settings.host}:{settings.port}: {e.strerror}"
            " (choose another with --port / --host or REDPACKET_PORT / REDPACKET_HOST)"
        ) from None
    sock.listen(2048)  # connections wait in the backlog until uvicorn accepts them
    return sock


def listen_metrics(settings: Settings, processes: int) -> list[socket.socket | None]:
    """With ``REDPACKET_METRICS_PORT``: one socket per hub process for its /metrics (ports from that
    one up), bound now so that a busy port is one line; else none."""
    if not settings.metrics_port:
        return [None] * processes
    out: list[socket.socket | None] = []
    for i in range(processes):
        port = settings.metrics_port + i
        try:
            out.append(socket.create_server((settings.metrics_host, port)))
        except OSError as e:
            for bound in out:
                assert bound is not None
                bound.close()
            raise OperatorError(
                f"cannot serve the hub's metrics on {settings.metrics_host}:{port}: {e.strerror}"
                " (choose another with REDPACKET_METRICS_PORT / REDPACKET_METRICS_HOST, 0 for the hub's port)"
            ) from None
    return out


def _banner(settings: Settings, port: int, workers: int = 1, up: bool = False) -> None:
    db = settings.database_url or f"SQLite {settings.sqlite_path}"
    print(f"redpacket hub on http://{settings.host}:{port}  websocket ws://{settings.host}:{port}/ws")
    processes = f", {workers} hub processes" if workers > 1 else ""
    print(f"  Redis {redact(settings.redis_url)}, database {redact(db)}{processes}", flush=True)
    print(f"  grab durability {settings.durability} (REDPACKET_GRAB_DURABILITY)", flush=True)
    if settings.metrics_port:
        last = settings.metrics_port + workers - 1
        ports = (
            f"{settings.metrics_port}" if workers == 1 else f"{settings.metrics_port}-{last} (one a process)"
        )
        print(
            f"  metrics on http://{settings.metrics_host}:{ports}/metrics, not on the hub's port", flush=True
        )
        if settings.console_key:
            print(f"  operators' console on http://{settings.metrics_host}:{ports}/console/", flush=True)
    if settings.console_key and settings.console_on_hub_port:
        where = f"http://{settings.host}:{port}/console/"
        print(f"  operators' console on the hub's port too: {where}", flush=True)
    if settings.dev_login or settings.demo_topup:
        on = " and ".join(
            w for w, f in (("DEV LOGIN", settings.dev_login), ("DEMO MONEY", settings.demo_topup)) if f
        )
        print(
            f"  {on} ON: whoever reaches this hub can log in as any user by name and top up from nothing."
            " A demo on this machine only (it listens on loopback), never a deployment",
            flush=True,
        )
    elif up:
        if settings.backend:
            why = "a chat backend is configured. Users connect with tokens your chat backend mints"
        else:
            why = (
                "it listens beyond this machine. Users connect with tokens signed with this hub's"
                f" REDPACKET_SECRET (kept in {settings.data_dir / 'secret'} unless set)"
            )
        print(
            f"  dev login and demo money are off: {why}, and money comes through the service API"
            " (docs/integration.md); the demo page's name login answers that it is switched off",
            flush=True,
        )
    if settings.dev_login:
        print(f'  try: curl -s -XPOST http://{settings.host}:{port}/api/login -d \'{{"name": "li"}}\'')


async def serve(
    settings: Settings,
    sock: socket.socket,
    with_worker: bool,
    supervised: bool = False,
    metrics_sock: socket.socket | None = None,
) -> None:
    """One hub process on ``sock``. ``supervised``: one of ``serve --workers``, whose supervisor has
    checked the services and printed the address already."""
    from server.hub.app import create_app

    if not supervised:
        await check_services(settings)
    from worker.main import GC_THRESHOLD, beside_hub

    beside = beside_hub if with_worker else None
    app = create_app(settings, beside=beside, manage_gc=True, metrics_sock=metrics_sock)
    server = _Server(uvicorn_config(app, settings))
    # With 10k sockets open a full collection pauses the loop for a quarter of a second: start-up objects
    # stay out of it, full collections wait for a quiet moment (server.hub.gcpolicy), and the young
    # generation is collected less often during bursts.
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLD)
    if not supervised:
        _banner(settings, sock.getsockname()[1], up=with_worker)
    if _stop_requested:
        return  # told to stop while starting up
    tracing.configure("redpacket-hub")  # (in each hub process: `serve --workers` forks before this)
    try:
        await server.serve(sockets=[sock])
    finally:
        await asyncio.to_thread(tracing.shutdown)  # what is buffered is sent, within the SDK's bound


def serve_processes(
    settings: Settings, sock: socket.socket, workers: int, metrics: list[socket.socket | None]
) -> int:
    """``serve --workers N``: the services checked once, then N hub processes on the one socket (each
    its own metrics socket, if any)."""
    from server.hub.procs import supervise

    uvloop.run(check_services(settings))
    _banner(settings, sock.getsockname()[1], workers)
    return supervise(
        workers,
        lambda slot: uvloop.run(
            serve(settings, sock, with_worker=False, supervised=True, metrics_sock=metrics[slot])
        ),
    )
