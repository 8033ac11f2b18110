"""Live red packets in group chat: run the hub and the worker, and the operator's tools.

Every mistake an operator can make (a missing secret, a busy port, a wrong URL, a database or Redis that
does not answer) ends the command with one line on stderr saying what is wrong and what to do, and a
non-zero exit code: 2 for a setting that is wrong as written, 1 for anything else.

Here: ``main``, the settings a command runs with, and which command runs what. Each command lives in a
module of its own: ``serve`` (up, serve), ``worker``, ``maintenance`` (migrate, reconcile, blocks,
recover), ``bench``; ``services`` finds Redis and checks what every command needs answers; ``parser`` is
the command line; ``errors`` the one error.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib.util
import logging
import os
import signal
import sys
from pathlib import Path

import uvloop

from server import logformat, tracing
from server.cli import maintenance
from server.cli.bench import bench
from server.cli.errors import OperatorError
from server.cli.parser import parser
from server.cli.serve import (
    demo_secret,
    hub_healthy,
    listen,
    listen_metrics,
    on_sigterm,
    serve,
    serve_processes,
)
from server.cli.services import with_redis_url
from server.cli.worker import run_worker, worker_healthy
from server.hub.handshake import UnsupportedUvicorn, check_uvicorn
from server.money import endpoints
from server.settings import Settings, is_loopback
from server.stopping import leave_within

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
READERS = ("reconcile", "blocks", "recover", "verify", "webhooks")


def _refuse(args: argparse.Namespace, settings: Settings) -> None:
    """What is wrong with the command as given, before anything starts."""
    command = args.command
    if command == "serve" and not settings.secret and "HS256" in settings.jwt_algorithm_list:
        raise OperatorError(
            "REDPACKET_SECRET is not set: `redpacket serve` checks HS256 tokens with it (a long random"
            " string, the same on every hub and in the app's backend), or set REDPACKET_JWT_PUBLIC_KEY or"
            " REDPACKET_JWKS_URL for RS256/ES256 tokens; `redpacket up` makes a secret for a demo",
            2,
        )
    if command == "serve" and not 1 <= args.workers <= 64:
        raise OperatorError("--workers is 1 to 64 (hub processes on this machine, one core each)", 2)
    if command in ("serve", "worker"):
        _refuse_unnamed_storage(command, settings)
    if command in ("up", "serve", "worker"):
        try:
            tracing.check(os.environ)  # (OTEL_*: the standard variables, checked here as ours are)
        except tracing.TracingError as e:
            raise OperatorError(str(e), 2) from None
    sqlite = settings.effective_database_url.removeprefix("sqlite:///")
    if command in READERS and sqlite != settings.effective_database_url and not Path(sqlite).exists():
        # A command that reads never creates: a fresh SQLite file would be reconciled "no difference".
        raise OperatorError(
            f"no database at {Path(sqlite).resolve()}: `redpacket {command}` reads the one"
            " `redpacket up` or `serve` made — run it in the same directory, or set REDPACKET_DATA_DIR or"
            " REDPACKET_DATABASE_URL"
        )


def _refuse_unnamed_storage(command: str, settings: Settings) -> None:
    """``serve`` and ``worker`` keep money where they are told, never in the demo's storage by default: with
    ``--workers N`` or several machines, each would have its own ledger."""
    if not settings.database_url:
        raise OperatorError(
            f"REDPACKET_DATABASE_URL is not set: `redpacket {command}` keeps the ledger in the database it"
            " names, the same for every hub and worker (mysql://user:password@host:3306/redpacket); for one"
            f" machine alone, name a SQLite file: REDPACKET_DATABASE_URL=sqlite:///{settings.sqlite_path.resolve()}"
            " (what `redpacket up` uses)",
            2,
        )
    if not settings.redis_url:
        raise OperatorError(
            f"REDPACKET_REDIS_URL is not set: `redpacket {command}` needs the Redis every hub and worker"
            " shares (redis://host:6379/0); REDPACKET_REDIS_URL=embedded runs the data directory's own"
            " Valkey (what `redpacket up` uses)",
            2,
        )


def _run(args: argparse.Namespace, settings: Settings) -> int:
    command = args.command
    if command == "worker" and args.check:
        return 0 if worker_healthy(settings) else 1
    if command == "serve" and args.check:
        return 0 if hub_healthy(settings) else 1
    if command == "migrate":
        uvloop.run(maintenance.migrate(settings))
        return 0
    if command == "bench":
        _need_tools("bench hot" if args.what == "hot" else "bench", plot=bool(args.plot))
    if command == "bench" and args.what == "tokens":  # pure CPU: no Redis, no database
        from bench.tokenbench import bench_tokens

        bench_tokens(plot=Path(args.plot) if args.plot else None)
        return 0
    if command == "bench" and args.what == "frames":  # pure CPU too
        from bench.framebench import bench_frames

        bench_frames(plot=Path(args.plot) if args.plot else None)
        return 0
    if command == "bench" and args.what == "tracing":  # pure CPU too
        from bench.tracebench import bench_tracing

        bench_tracing(plot=Path(args.plot) if args.plot else None)
        return 0
    if command == "bench" and args.what == "split":  # pure CPU too
        from bench.splitbench import bench_split

        bench_split(plot=Path(args.plot) if args.plot else None)
        return 0
    if command == "bench" and args.what == "grab-script":  # a throw-away redis-server of its own
        from bench.scriptbench import bench_grab_script
        from launchers.throwaway import Setup

        setup = Setup(args.redis_setup)
        config = [w if i else f"--{w}" for option in args.redis_config for i, w in enumerate(option.split())]
        bench_grab_script(args.script, args.rounds, setup, args.instructions, args.ablations, config=config)
        return 0
    sock = None
    _refuse(args, settings)
    if command in ("up", "serve"):
        try:
            check_uvicorn()  # the hub's protocol classes build on uvicorn's: only a tested one will do
        except UnsupportedUvicorn as e:
            raise OperatorError(str(e)) from None
        # Bound first, before anything starts: a busy port is said at once, port 0 works, and the address
        # printed is the one listening.
        sock = listen(settings)
        metrics = listen_metrics(settings, args.workers if command == "serve" else 1)
    with with_redis_url(settings, command) as s:
        if command == "up" and sock is not None:
            uvloop.run(serve(demo_secret(s), sock, with_worker=True, metrics_sock=metrics[0]))
        elif command == "serve" and sock is not None and args.workers > 1:
            return serve_processes(s, sock, args.workers, metrics)
        elif command == "serve" and sock is not None:
            uvloop.run(serve(s, sock, with_worker=False, metrics_sock=metrics[0]))
        elif command == "worker":
            uvloop.run(run_worker(s))
            faulthandler.cancel_dump_traceback_later()  # (its loop ended: the exit's own bound follows)
        elif command == "blocks":
            uvloop.run(maintenance.blocks(s, args.lift))
        elif command == "recover":
            return uvloop.run(maintenance.recover(s, args.packet_ids))
        elif command == "verify":
            return uvloop.run(maintenance.verify(s, args.packet_id, args.commitment))
        elif command == "reconcile":
            return 0 if uvloop.run(maintenance.reconcile(s, args.json)) else 1
        elif command == "webhooks":
            uvloop.run(maintenance.webhooks(s, getattr(args, "since", None), getattr(args, "after", None)))
        else:
            uvloop.run(bench(s, args))
    return 0


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["load"]:
        _load(argv[1:])
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=logformat.TEXT)
    # arq writes a line per periodic job run (several a minute); its warnings and errors still show.
    logging.getLogger("arq.worker").setLevel(logging.WARNING)
    # httpx writes a line per request with its whole URL, credentials and query included (a hook's, a
    # webhook's): a line per delivery and per send, and a secret in the log. Its warnings still show.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    # uvicorn drains on SIGTERM, then raises the signal again; end with a clean exit instead, so the
    # cleanup below (the embedded Valkey's shutdown) still runs.
    signal.signal(signal.SIGTERM, on_sigterm)
    # The terminal closed (SIGHUP): stop as on Ctrl-C, so the embedded Valkey — in a session of its own,
    # out of the terminal's reach — is still stopped on the way out, last.
    signal.signal(signal.SIGHUP, lambda _s, _f: os.kill(os.getpid(), signal.SIGINT))
    # SIGUSR1 tells a hub or worker to go back to its first database node (server.core); until one
    # takes it, and in every other command, it is not the end of the process (its default action).
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    faulthandler.enable()  # a crash in C code (or SIGABRT) still says where
    try:
        try:
            settings = _settings(args)
            logformat.use(settings.log_format)
            code = _run(args, settings)
        except OperatorError as e:
            print(f"redpacket: {e}", file=sys.stderr)
            code = e.exit_code
        except KeyboardInterrupt:
            code = 0
        sys.exit(code)
    finally:
        # Exiting waits for every non-daemon thread (aiosqlite runs one per connection). Should one be
        # left running, say where everything is after EXIT_SECONDS and end the process rather than hang.
        leave_within()


def _load(argv: list[str]) -> None:
    """``redpacket load``: its own flags, every other one Locust's (so not through ``parser``)."""
    try:
        if not {"-h", "--help"} & set(argv):  # (its help reads without them)
            _need_tools("load", plot="--plot" in argv)
    except OperatorError as e:
        print(f"redpacket: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    from bench import load

    logging.basicConfig(level=logging.INFO, format=logformat.TEXT)
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
        endpoints.configured(settings)  # REDPACKET_WEBHOOK_ENDPOINTS read and checked, as the rest
    except ValueError as e:  # a setting that cannot be read as written
        raise OperatorError(str(e), 2) from None
    return settings
