"""The ``redpacket`` command: ``up``, ``worker``, ``migrate``, ``recover`` and ``bench``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import socket
import sys
from collections.abc import AsyncIterator, Iterator

import uvicorn
import uvloop

from server.core import Core, open_core
from server.embedded import embedded_valkey
from server.settings import Settings

log = logging.getLogger("redpacket")


@contextlib.contextmanager
def _redis_url(settings: Settings) -> Iterator[Settings]:
    """The settings with a Redis URL: the configured one, or an embedded Valkey started now."""
    if settings.redis_url:
        yield settings
        return
    with embedded_valkey(settings.data_dir) as url:
        yield settings.with_(redis_url=url)


@contextlib.asynccontextmanager
async def _worker_task(core: Core) -> AsyncIterator[None]:
    from worker.main import make_worker

    worker = make_worker(core)
    task = asyncio.create_task(worker.async_run())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _serve(settings: Settings, with_worker: bool) -> None:
    from server.api import create_app

    async with open_core(settings) as core, _worker_task(core) if with_worker else contextlib.nullcontext():
        # Bind first, so that port 0 works and the address printed is the one listening.
        sock = socket.socket(socket.AF_INET6 if ":" in settings.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((settings.host, settings.port))
        port = sock.getsockname()[1]
        config = uvicorn.Config(create_app(core), log_level="warning", ws_per_message_deflate=False)
        db = settings.database_url or f"SQLite {settings.sqlite_path}"
        print(f"redpacket is up: http://{settings.host}:{port}  (Redis {settings.redis_url}, database {db})")
        print(f'  try: curl -s -XPOST http://{settings.host}:{port}/api/login -d \'{{"name": "li"}}\'')
        print("  stop with Ctrl-C", flush=True)
        await uvicorn.Server(config).serve(sockets=[sock])


async def _worker(settings: Settings) -> None:
    from worker.main import make_worker

    async with open_core(settings) as core:
        worker = make_worker(core, handle_signals=True)
        log.info("worker consuming %s", settings.queue_name)
        await worker.async_run()


async def _migrate(settings: Settings) -> None:
    from server import schema
    from server.db import connect

    db = await connect(settings.effective_database_url)
    try:
        applied = await schema.migrate(db)
        print(f"applied migrations: {applied or 'none (up to date)'}; schema version {schema.LATEST}")
    finally:
        await db.close()


async def _recover(settings: Settings, packet_ids: list[int]) -> None:
    from server.packets import recover_packet

    async with open_core(settings) as core:
        for pid in packet_ids:
            r = await recover_packet(core, pid)
            print(f"packet {pid}: {r.shares_left} shares left, {r.grabs_known} grabs known")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="redpacket", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start everything on this machine (embedded Valkey + SQLite by default)")
    up.add_argument("--host")
    up.add_argument("--port", type=int)
    serve = sub.add_parser("serve", help="serve the API only (run workers with `redpacket worker`)")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    sub.add_parser(
        "worker", help="run the credit worker against REDPACKET_REDIS_URL / REDPACKET_DATABASE_URL"
    )
    sub.add_parser("migrate", help="apply database migrations")
    rec = sub.add_parser("recover", help="rebuild packets' Redis state from the database")
    rec.add_argument("packet_ids", type=int, nargs="+")
    bench = sub.add_parser("bench", help="print benchmark figures and a JSON line")
    bench.add_argument("what", choices=["grab"])
    bench.add_argument("--grabs", type=int, default=20_000, help="grabs per measured mode")
    args = parser.parse_args(argv)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = Settings.from_env()
    if args.command in ("up", "serve"):
        if args.host:
            settings = settings.with_(host=args.host)
        if args.port is not None:
            settings = settings.with_(port=args.port)
    try:
        with _redis_url(settings) as s:
            if args.command in ("up", "serve"):
                uvloop.run(_serve(s, with_worker=args.command == "up"))
            elif args.command == "worker":
                uvloop.run(_worker(s))
            elif args.command == "migrate":
                uvloop.run(_migrate(s))
            elif args.command == "recover":
                uvloop.run(_recover(s, args.packet_ids))
            elif args.command == "bench":
                from server.bench import run_grab_bench

                uvloop.run(run_grab_bench(s, args.grabs))
    except KeyboardInterrupt:
        pass
    sys.exit(0)
