"""Live red packets in group chat: run the hub and the worker, and the operator's tools.

Every mistake an operator can make (a missing secret, a busy port, a wrong URL, a database or Redis that
does not answer) ends the command with one line on stderr saying what is wrong and what to do, and a
non-zero exit code: 2 for a setting that is wrong as written, 1 for anything else.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import faulthandler
import gc
import importlib.util
import logging
import os
import re
import secrets
import signal
import socket
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import uvicorn
import uvloop
from redis.asyncio import Redis
from redis.exceptions import RedisClusterException, RedisError

from server.core import open_core
from server.hub.wire import uvicorn_config
from server.settings import Settings, fsyncs, is_loopback, redact
from server.store.batch import durability_problem
from server.store.db import DatabaseError
from server.store.embedded import EmbeddedError, embedded_valkey
from server.store.redisnodes import RedisNodes

log = logging.getLogger("redpacket")

# A backing service that does not answer within this long at start-up is reported, not waited on.
STARTUP_CHECK_SECONDS = 5.0


class OperatorError(Exception):
    """Something the operator can fix; ``main`` prints it as one line and exits with ``exit_code``."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@contextlib.contextmanager
def _redis_url(settings: Settings, command: str) -> Iterator[Settings]:
    """The settings with a Redis URL: the configured one, or the data directory's embedded Valkey (the
    one a running ``redpacket`` process serves, or one started now)."""
    if settings.redis_url:
        yield settings
        return
    # The embedded Valkey makes grabs durable on its disk unless told otherwise: appendfsync always
    # (the event loop fsyncs all of one iteration's writes at once), and every grab waits for it.
    durability = settings.grab_durability or "aof"
    fsync = "always" if fsyncs(durability) else "everysec"
    try:
        with embedded_valkey(
            settings.data_dir,
            settings.embedded_redis_port,
            exclusive=command == "up",
            owner=command,
            fsync=fsync,
        ) as url:
            yield settings.replace(redis_url=url, grab_durability=durability)
    except EmbeddedError as e:
        raise OperatorError(str(e)) from None


async def _check_services(settings: Settings, redis_too: bool = True, durability: bool = True) -> None:
    """Fail fast, in one line, if the database or Redis does not answer (or, with ``durability``, cannot
    make grabs as durable as the settings ask)."""
    from server.store.db import connect

    try:
        db = await asyncio.wait_for(connect(settings.effective_database_url, 1), STARTUP_CHECK_SECONDS)
        await db.close()
    except TimeoutError:
        raise OperatorError(
            f"the database at {redact(settings.effective_database_url)} does not answer (timed out)"
            " (check REDPACKET_DATABASE_URL)"
        ) from None
    except DatabaseError as e:  # it says what is wrong: no such database, a refused user, no server
        raise OperatorError(f"{e} (check REDPACKET_DATABASE_URL)") from None
    if not redis_too:
        return
    nodes = RedisNodes(settings.redis_url, 4)
    try:
        await asyncio.wait_for(nodes.open(), STARTUP_CHECK_SECONDS + 1)
        masters = nodes.masters().items()
    except RedisClusterException as e:  # (not a RedisError)
        raise OperatorError(
            f"Redis at {redact(settings.redis_url)} is not a cluster, or no node of it answers: {e}"
            " (check REDPACKET_REDIS_URL: redis+cluster:// is for a Redis Cluster, redis:// for one server)"
        ) from None
    except (RedisError, OSError, TimeoutError) as e:
        raise OperatorError(
            f"Redis at {redact(settings.redis_url)} does not answer: {e or 'timed out'}"
            " (check REDPACKET_REDIS_URL)"
        ) from None
    try:
        for name, client in masters if durability else ():
            try:
                await asyncio.wait_for(_check_durability(settings, name, client), STARTUP_CHECK_SECONDS)
            except (RedisError, OSError, TimeoutError) as e:
                raise OperatorError(f"Redis at {name} does not answer: {e or 'timed out'}") from None
        if durability and fsyncs(settings.durability):
            await _check_replicas(settings, nodes)
    finally:
        await nodes.aclose()
    if settings.queue_url != settings.redis_url:
        q = Redis.from_url(settings.queue_url, socket_connect_timeout=STARTUP_CHECK_SECONDS, socket_timeout=5)
        try:
            await asyncio.wait_for(q.ping(), STARTUP_CHECK_SECONDS + 1)
        except (RedisError, OSError, TimeoutError) as e:
            raise OperatorError(
                f"arq's queue Redis at {redact(settings.queue_url)} does not answer: {e or 'timed out'}"
                " (check REDPACKET_QUEUE_REDIS_URL)"
            ) from None
        finally:
            await q.aclose()


async def _check_replicas(settings: Settings, nodes: RedisNodes) -> None:
    """A cluster's replicas fsync as their masters must (each is its master one day); one that cannot be
    read now is a warning line, not a reason to stay down too."""
    try:
        replicas = await asyncio.wait_for(nodes.replicas_known(), STARTUP_CHECK_SECONDS)
    except (RedisError, OSError, TimeoutError) as e:  # (an ACL refusing CLUSTER NODES, say)
        log.warning("the cluster's replicas not checked (%s): each must fsync as its master does", e)
        return
    for name, client in replicas.items():
        try:
            await asyncio.wait_for(
                _check_durability(settings, name, client, replica=True), STARTUP_CHECK_SECONDS
            )
        except (RedisError, OSError, TimeoutError) as e:
            log.warning("Redis replica at %s not checked (%s): it must fsync as its master does", name, e)


async def _check_durability(settings: Settings, name: str, client: Redis, replica: bool = False) -> None:
    """Refuse to start when grabs cannot be made as durable as REDPACKET_GRAB_DURABILITY asks."""
    problem = await durability_problem(client, settings.durability, replica)
    if problem is not None:
        raise OperatorError(
            f"REDPACKET_GRAB_DURABILITY={settings.durability} cannot be had on Redis at {name}: {problem}"
            " (configure the server so, or choose another durability)"
        )


class _Server(uvicorn.Server):
    """uvicorn's server; a stop that takes longer than the drain budget says where it is stuck: every
    thread's stack on stderr (it keeps stopping meanwhile)."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            budget = self.config.timeout_graceful_shutdown or 0
            faulthandler.dump_traceback_later(budget + 5, exit=False)
            with contextlib.suppress(RuntimeError):  # and what every task still waits for
                asyncio.get_running_loop().call_later(budget + 5, _print_tasks)
        super().handle_exit(sig, frame)


def _print_tasks() -> None:
    tasks = asyncio.all_tasks()
    print(f"still running after the drain budget: {len(tasks)} task(s)", file=sys.stderr)
    for task in tasks:
        print(f"--- {task!r}", file=sys.stderr)
        task.print_stack(limit=12, file=sys.stderr)
    sys.stderr.flush()


def _demo_secret(settings: Settings) -> Settings:
    """`up` is the embedded demo: a secret kept under the data dir (dev login and top-ups are on:
    ``_settings``)."""
    if settings.secret:
        return settings
    path = settings.data_dir / "secret"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(secrets.token_hex(32))
        path.chmod(0o600)
    return settings.replace(secret=path.read_text().strip())


def _listen(settings: Settings) -> socket.socket:
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


def _listen_metrics(settings: Settings, processes: int) -> list[socket.socket | None]:
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
    if settings.metrics_port:
        last = settings.metrics_port + workers - 1
        ports = (
            f"{settings.metrics_port}" if workers == 1 else f"{settings.metrics_port}-{last} (one a process)"
        )
        print(
            f"  metrics on http://{settings.metrics_host}:{ports}/metrics, not on the hub's port", flush=True
        )
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


async def _serve(
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
        await _check_services(settings)
    app = create_app(settings, run_worker=with_worker, manage_gc=True, metrics_sock=metrics_sock)
    server = _Server(uvicorn_config(app, settings))
    # With 10k sockets open a full collection pauses the loop for a quarter of a second: start-up objects
    # stay out of it, full collections wait for a quiet moment (server.hub.gcpolicy), and the young
    # generation is collected less often during bursts.
    gc.freeze()
    gc.set_threshold(20_000, 20, 100)
    if not supervised:
        _banner(settings, sock.getsockname()[1], up=with_worker)
    if _stop_requested:
        return  # told to stop while starting up
    await server.serve(sockets=[sock])


def _serve_processes(
    settings: Settings, sock: socket.socket, workers: int, metrics: list[socket.socket | None]
) -> int:
    """``serve --workers N``: the services checked once, then N hub processes on the one socket (each
    its own metrics socket, if any)."""
    from server.hub.procs import supervise

    uvloop.run(_check_services(settings))
    _banner(settings, sock.getsockname()[1], workers)
    return supervise(
        workers,
        lambda slot: uvloop.run(
            _serve(settings, sock, with_worker=False, supervised=True, metrics_sock=metrics[slot])
        ),
    )


async def _worker(settings: Settings) -> None:
    from prometheus_client import start_http_server

    from worker.main import running_worker
    from worker.metrics import WorkerMetrics

    await _check_services(settings)
    async with open_core(settings) as core:
        metrics = WorkerMetrics()
        if settings.worker_metrics_port:
            try:
                start_http_server(settings.worker_metrics_port, addr=settings.host, registry=metrics.registry)
            except OSError as e:
                raise OperatorError(
                    f"cannot serve worker metrics on {settings.host}:{settings.worker_metrics_port}:"
                    f" {e.strerror} (set REDPACKET_WORKER_METRICS_PORT, 0 for none)"
                ) from None
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        # SIGINT/SIGTERM: the drain gives back the claims of a batch not yet paid (or they lapse), arq's
        # running jobs are cancelled (each is idempotent and runs again later); then the process exits.
        async with running_worker(core, metrics):
            log.info("worker running; metrics on port %s", settings.worker_metrics_port or "(off)")
            await stop.wait()


def _worker_healthy(settings: Settings) -> bool:
    """The health of the worker whose metrics this host serves on ``REDPACKET_WORKER_METRICS_PORT``
    (in compose: the worker of this container): healthy if its last heartbeat reached Redis and the
    database within ``HEALTHY_WITHIN`` seconds."""
    from worker.main import HEALTHY_WITHIN

    if not settings.worker_metrics_port:
        raise OperatorError(
            "worker --check reads the worker's metrics: REDPACKET_WORKER_METRICS_PORT is 0", 2
        )
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "", "::") else settings.host
    url = f"http://{host}:{settings.worker_metrics_port}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
    except OSError as e:
        print(f"unhealthy: no worker answers on {url} ({e})")
        return False
    beat = re.search(r"^redpacket_worker_healthy_at_seconds (\S+)$", text, re.MULTILINE)
    at = float(beat[1]) if beat else 0.0
    if not at:
        print("unhealthy: the worker has not reached Redis and the database yet")
        return False
    age = time.time() - at
    print(f"{'healthy' if age < HEALTHY_WITHIN else 'unhealthy'}: last heartbeat {age:.0f} s ago")
    return age < HEALTHY_WITHIN


async def _migrate(settings: Settings) -> None:
    from server.store import schema
    from server.store.db import connect

    await _check_services(settings, redis_too=False)
    db = await connect(settings.effective_database_url)
    try:
        applied = await schema.migrate(db)
        print(f"applied migrations: {applied or 'none (up to date)'}; schema version {schema.LATEST}")
    finally:
        await db.close()


def _when(ms: int) -> str:
    at = datetime.datetime.fromtimestamp(ms / 1000, tz=datetime.UTC)
    left = max(0, ms // 1000 - int(time.time()))
    return f"{at:%Y-%m-%d %H:%M:%S} UTC (in {left // 60} min {left % 60} s)"


async def _blocks(settings: Settings, lift: int | None) -> None:
    from server.hub import bots

    await _check_services(settings)
    async with open_core(settings) as core:
        if lift is not None:
            print(f"user {lift}: {'unblocked' if await bots.lift(core, lift) else 'was not blocked'}")
            return
        shown = await bots.list_blocks(core)
        for b in shown:
            what = "blocked" if b.action == "block" else "throttled (one grab in 5 s)"
            print(f"user {b.user} {what} until {_when(b.until_ms)}: {b.reasons}")
        blocked = sum(1 for b in shown if b.action == "block")
        print(f"{blocked} blocked, {len(shown) - blocked} throttled")


async def _reconcile(settings: Settings) -> bool:
    from server.money.reconcile import reconcile, render

    # Redis too: what it told grabbers is checked against the ledger.
    await _check_services(settings, durability=False)
    async with open_core(settings) as core:
        report = await reconcile(core)
    print(render(report))
    return report.ok


async def _recover(settings: Settings, packet_ids: list[int]) -> None:
    from server.errors import RedPacketError
    from server.ids import MAX_ID
    from server.money.packets import recover_packet

    if bad := [p for p in packet_ids if not 1 <= p <= MAX_ID]:
        raise OperatorError(f"no packet can have the id {bad[0]}", 2)
    await _check_services(settings)
    async with open_core(settings) as core:
        for pid in packet_ids:
            try:
                r = await recover_packet(core, pid)
            except RedPacketError as e:
                print(f"packet {pid}: {e.message}")
                continue
            except RedisError as e:  # Redis restarted under the command: said, and the next one goes on
                print(f"packet {pid}: Redis is unavailable ({e}); run it again")
                continue
            print(f"packet {pid}: {r.shares_left} shares left, {r.grabs_known} grabs known")


async def _bench(settings: Settings, args: argparse.Namespace) -> None:
    from server.tools import hotbench, hubbench
    from server.tools.bench import run_db_read_bench, run_grab_bench
    from server.tools.creditbench import bench_credit, bench_storm

    await _check_services(settings)
    what = args.what
    plot = Path(args.plot) if args.plot else None
    if what == "grab":
        await run_grab_bench(settings, args.grabs, plot=plot)
    elif what == "db-read":
        await run_db_read_bench(settings, plot=plot)
    elif what == "hub-grab":
        await hubbench.bench_hub_grab(settings, workers=args.workers, plot=plot)
    elif what == "credit":
        await bench_credit(settings, plot=plot)
    elif what == "storm":
        await bench_storm(settings, args.rate, args.seconds, plot=plot)
    elif what == "fanout":
        await hubbench.bench_fanout(settings, plot=plot)
    else:
        await hotbench.bench_hot(
            settings, args.clients, workers=args.workers, client_procs=args.client_procs, plot=plot
        )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="redpacket",
        description="Live red packets in group chat: the hub, the worker, and the operator's tools.",
        epilog="Settings come from REDPACKET_* environment variables (README: Configuration). Without"
        " REDPACKET_REDIS_URL and REDPACKET_DATABASE_URL everything runs on an embedded Valkey and a"
        " SQLite file under REDPACKET_DATA_DIR (.redpacket).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def listen_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--host", help="address to listen on (default: REDPACKET_HOST or 127.0.0.1)")
        p.add_argument(
            "--port", type=int, help="port to listen on, 0 for any free one (default: REDPACKET_PORT or 8000)"
        )

    listen_options(
        sub.add_parser("up", help="the hub and a worker in one process, dev login and demo money on (a demo)")
    )
    serve = sub.add_parser(
        "serve", help="the hub only (production; needs REDPACKET_SECRET; run workers apart)"
    )
    listen_options(serve)
    serve.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="hub processes sharing the listening socket, one core each (default 1)",
    )
    wk = sub.add_parser(
        "worker", help="the worker: credits, refunds, announcements, sweeper, reconciliation, bots"
    )
    wk.add_argument(
        "--check", action="store_true", help="exit 0 if this host's worker is healthy (its metrics port)"
    )
    sub.add_parser("migrate", help="apply database migrations (every start does this too)")
    sub.add_parser("reconcile", help="check every cent; print a report; exit 1 on any difference")
    blocks = sub.add_parser("blocks", help="list the users the bot detector blocked, and why and until when")
    blocks.add_argument(
        "--lift", type=int, metavar="USER", help="lift the block (and throttle) of this user id"
    )
    rec = sub.add_parser(
        "recover", help="rebuild packets' Redis state from the database (safe while grabs go on)"
    )
    rec.add_argument(
        "packet_ids", type=int, nargs="+", metavar="PACKET_ID", help="a packet whose Redis state to rebuild"
    )
    # Parsed by server.tools.load (every flag it does not know goes to Locust): listed here for --help only.
    sub.add_parser(
        "load",
        add_help=False,
        help="Locust step-up load against a hub (redpacket load --help; docs/load.md)",
    )
    bench = sub.add_parser("bench", help="print benchmark figures and a JSON line (docs/benchmarks.md)")
    bench.add_argument(
        "what", choices=["grab", "hub-grab", "fanout", "hot", "credit", "storm", "db-read", "tokens"]
    )
    bench.add_argument("--grabs", type=int, default=20_000, help="grabs per measured mode (grab)")
    bench.add_argument("--clients", type=int, default=10_000, help="connected clients (hot)")
    bench.add_argument(
        "--workers", type=int, default=1, help="hub processes: serve --workers (hub-grab, hot)"
    )
    bench.add_argument("--client-procs", type=int, default=1, help="load client processes (hot)")
    bench.add_argument("--rate", type=int, default=2_000, help="grabs per second (storm)")
    bench.add_argument("--seconds", type=int, default=30, help="how long the grabs go on (storm)")
    bench.add_argument("--plot", metavar="DIR", help="write PNG plots of the run into DIR")
    return parser


# What the commands around the system need beyond it (the `tools` extra of pyproject.toml).
TOOLS = {
    "bench": ("rich",),  # progress bars
    "bench hot": ("rich", "picows"),  # its client processes
    "load": ("locust", "websocket", "rich"),
    "--plot": ("matplotlib",),
}


def _need_tools(command: str, plot: bool = False) -> None:
    wanted = TOOLS.get(command, ()) + (TOOLS["--plot"] if plot else ())
    missing = [m for m in wanted if importlib.util.find_spec(m) is None]
    if missing:
        raise OperatorError(
            f"`redpacket {command}` needs the tools ({', '.join(missing)} missing): pip install -e '.[tools]'"
            " in a clone (or pip install 'redpacket[tools]')",
            2,
        )


# Commands that read the ledger and must find it, never make an empty one.
READERS = ("reconcile", "blocks", "recover")


def _run(args: argparse.Namespace, settings: Settings) -> int:
    command = args.command
    if command == "worker" and args.check:
        return 0 if _worker_healthy(settings) else 1
    if command == "migrate":
        uvloop.run(_migrate(settings))
        return 0
    if command == "bench":
        _need_tools("bench hot" if args.what == "hot" else "bench", plot=bool(args.plot))
    if command == "bench" and args.what == "tokens":  # pure CPU: no Redis, no database
        from server.tools.tokenbench import bench_tokens

        bench_tokens(plot=Path(args.plot) if args.plot else None)
        return 0
    sock = None
    if command == "serve" and not settings.secret and "HS256" in settings.jwt_algorithm_list:
        raise OperatorError(
            "REDPACKET_SECRET is not set: `redpacket serve` checks HS256 tokens with it (a long random"
            " string, the same on every hub and in the app's backend), or set REDPACKET_JWT_PUBLIC_KEY or"
            " REDPACKET_JWKS_URL for RS256/ES256 tokens; `redpacket up` makes a secret for a demo",
            2,
        )
    if command == "serve" and not 1 <= args.workers <= 64:
        raise OperatorError("--workers is 1 to 64 (hub processes on this machine, one core each)", 2)
    sqlite = settings.effective_database_url.removeprefix("sqlite:///")
    if command in READERS and sqlite != settings.effective_database_url and not Path(sqlite).exists():
        # A command that reads never creates: a fresh SQLite file would be reconciled "no difference".
        raise OperatorError(
            f"no database at {Path(sqlite).resolve()}: `redpacket {command}` reads the one"
            " `redpacket up` or `serve` made — run it in the same directory, or set REDPACKET_DATA_DIR or"
            " REDPACKET_DATABASE_URL"
        )
    if command in ("up", "serve"):
        # Bound first, before anything starts: a busy port is said at once, port 0 works, and the address
        # printed is the one listening.
        sock = _listen(settings)
        metrics = _listen_metrics(settings, args.workers if command == "serve" else 1)
    with _redis_url(settings, command) as s:
        if command == "up" and sock is not None:
            uvloop.run(_serve(_demo_secret(s), sock, with_worker=True, metrics_sock=metrics[0]))
        elif command == "serve" and sock is not None and args.workers > 1:
            return _serve_processes(s, sock, args.workers, metrics)
        elif command == "serve" and sock is not None:
            uvloop.run(_serve(s, sock, with_worker=False, metrics_sock=metrics[0]))
        elif command == "worker":
            uvloop.run(_worker(s))
        elif command == "blocks":
            uvloop.run(_blocks(s, args.lift))
        elif command == "recover":
            uvloop.run(_recover(s, args.packet_ids))
        elif command == "reconcile":
            return 0 if uvloop.run(_reconcile(s)) else 1
        else:
            uvloop.run(_bench(s, args))
    return 0


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["load"]:
        _load(argv[1:])
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # arq writes a line per periodic job run (several a minute); its warnings and errors still show.
    logging.getLogger("arq.worker").setLevel(logging.WARNING)
    # uvicorn drains on SIGTERM, then raises the signal again; end with a clean exit instead, so the
    # cleanup below (the embedded Valkey's shutdown) still runs.
    signal.signal(signal.SIGTERM, _on_sigterm)
    # The terminal closed (SIGHUP): stop as on Ctrl-C, so the embedded Valkey — in a session of its own,
    # out of the terminal's reach — is still stopped on the way out, last.
    signal.signal(signal.SIGHUP, lambda _s, _f: os.kill(os.getpid(), signal.SIGINT))
    faulthandler.enable()  # a crash in C code (or SIGABRT) still says where
    try:
        try:
            code = _run(args, _settings(args))
        except OperatorError as e:
            print(f"redpacket: {e}", file=sys.stderr)
            code = e.exit_code
        except KeyboardInterrupt:
            code = 0
        sys.exit(code)
    finally:
        # Exiting waits for every non-daemon thread (aiosqlite runs one per connection). Should one be
        # left running, say where everything is after 15 s and end the process rather than hang.
        faulthandler.dump_traceback_later(15, exit=True)


_stop_requested = False


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    """SIGTERM outside uvicorn's drain: exit cleanly. Remembered too: a SystemExit raised while a weakref
    callback runs (the import system's, during start-up) is printed and dropped, and the hub must then
    still not start serving."""
    global _stop_requested
    _stop_requested = True
    sys.exit(0)


def _load(argv: list[str]) -> None:
    """``redpacket load``: its own flags, every other one Locust's (so not through ``_parser``)."""
    try:
        if not {"-h", "--help"} & set(argv):  # (its help reads without them)
            _need_tools("load", plot="--plot" in argv)
    except OperatorError as e:
        print(f"redpacket: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    from server.tools import load

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        code = load.run(argv)
    except load.LoadError as e:
        print(f"redpacket: {e}", file=sys.stderr)
        code = 2
    sys.exit(code)


def _settings(args: argparse.Namespace) -> Settings:
    try:
        settings = Settings.from_env()
        if args.command in ("up", "serve"):
            if args.host:
                settings = settings.replace(host=args.host)
            if args.port is not None:
                settings = settings.replace(port=args.port)
        if args.command == "up" and is_loopback(settings.host) and not settings.backend:
            # The demo: log in by name, play money — on this machine alone, with no chat backend.
            settings = settings.replace(dev_login=True, demo_topup=True)
        if args.command == "up" and not settings.allowed_origins:
            settings = settings.replace(allowed_origins="self")  # the demo page's websockets, no other site's
        settings.check()
    except ValueError as e:  # a setting that cannot be read as written
        raise OperatorError(str(e), 2) from None
    return settings
