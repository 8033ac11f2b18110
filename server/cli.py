"""The ``redpacket`` command: ``up``, ``worker``, ``migrate``, ``recover`` and ``bench``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import secrets
import signal
import socket
import sys
from collections.abc import Iterator

import uvicorn
import uvloop

from server.core import open_core
from server.embedded import embedded_valkey
from server.handshake import bounded_protocols
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


def uvicorn_config(app: object, settings: Settings) -> uvicorn.Config:
    """How the hub runs under uvicorn: websockets-sansio with bounded handshakes (``server.handshake``),
    no compression unless asked, frame cap, pings."""
    http, ws = bounded_protocols(settings.handshake_seconds)
    return uvicorn.Config(
        app,  # type: ignore[arg-type]
        http=http,
        ws=ws,
        ws_per_message_deflate=settings.ws_compression,
        ws_max_size=settings.ws_max_frame_bytes,
        ws_ping_interval=settings.ws_ping_interval,
        ws_ping_timeout=settings.ws_ping_timeout,
        timeout_graceful_shutdown=settings.shutdown_seconds,
        log_level="warning",
        access_log=False,
    )


def _demo_secret(settings: Settings) -> Settings:
    """`up` is the embedded demo: a secret kept under the data dir, dev login and top-ups on."""
    if settings.secret:
        return settings.with_(dev_login=True, demo_topup=True)
    path = settings.data_dir / "secret"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(secrets.token_hex(32))
        path.chmod(0o600)
    return settings.with_(secret=path.read_text().strip(), dev_login=True, demo_topup=True)


async def _serve(settings: Settings, with_worker: bool) -> None:
    from server.app import create_app

    # Bind first, so that port 0 works and the address printed is the one listening.
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY on accepted sockets only when the listening
    # socket says so; without it every reply behind an event waits out a 40 ms delayed ACK.
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((settings.host, settings.port))
    sock.listen(2048)  # connections wait in the backlog until uvicorn accepts them
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(create_app(settings, run_worker=with_worker), settings))
    # With 10k sockets open a full collection pauses the loop for most of a second: keep start-up objects
    # out of it, and collect the young generation less often during bursts.
    gc.freeze()
    gc.set_threshold(20_000, 20, 100)
    db = settings.database_url or f"SQLite {settings.sqlite_path}"
    print(f"redpacket hub on http://{settings.host}:{port}  websocket ws://{settings.host}:{port}/ws")
    print(f"  Redis {settings.redis_url}, database {db}", flush=True)
    if settings.dev_login:
        print(f'  try: curl -s -XPOST http://{settings.host}:{port}/api/login -d \'{{"name": "li"}}\'')
    await server.serve(sockets=[sock])


async def _worker(settings: Settings) -> None:
    from worker.drain import CreditDrain
    from worker.main import make_worker

    # A worker process runs a few hundred credit jobs at once; each needs a Redis connection.
    async with open_core(settings.with_(redis_pool_size=max(settings.redis_pool_size, 256))) as core:
        from prometheus_client import start_http_server

        from worker.metrics import WorkerMetrics

        metrics = WorkerMetrics()
        if settings.worker_metrics_port:
            start_http_server(settings.worker_metrics_port, addr=settings.host, registry=metrics.registry)
        worker = make_worker(core, metrics, handle_signals=True)
        log.info("worker consuming %s; metrics on port %s", settings.queue_name, settings.worker_metrics_port)
        drain = asyncio.create_task(CreditDrain(core, metrics).run())
        # On SIGINT/SIGTERM arq cancels its running jobs (each rolls back; arq runs it again later)
        # and its main task: that cancellation is the normal way out. The credit drain stops with it.
        try:
            with contextlib.suppress(asyncio.CancelledError):
                await worker.async_run()
        finally:
            drain.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await drain


async def _worker_healthy(settings: Settings) -> bool:
    """arq writes a health line under ``<queue>:health-check`` every minute; present means alive."""
    from arq.constants import health_check_key_suffix

    from server.queue import make_redis

    redis = make_redis(settings)
    try:
        line = await redis.get(settings.queue_name + health_check_key_suffix)
    finally:
        await redis.aclose(close_connection_pool=True)
    print(line.decode() if line else "no worker health line")
    return line is not None


async def _migrate(settings: Settings) -> None:
    from server import schema
    from server.db import connect

    db = await connect(settings.effective_database_url)
    try:
        applied = await schema.migrate(db)
        print(f"applied migrations: {applied or 'none (up to date)'}; schema version {schema.LATEST}")
    finally:
        await db.close()


async def _blocks(settings: Settings, lift: int | None) -> None:
    from server import bots

    async with open_core(settings) as core:
        if lift is not None:
            print(f"user {lift}: {'unblocked' if await bots.lift(core, lift) else 'was not blocked'}")
            return
        shown = await bots.list_blocks(core)
        for b in shown:
            print(f"user {b.user} blocked until {b.until_ms} (unix ms): {b.reasons}")
        print(f"{len(shown)} blocked")


async def _reconcile(settings: Settings) -> bool:
    from server import schema
    from server.db import connect
    from server.reconcile import reconcile, render

    db = await connect(settings.effective_database_url)
    try:
        await schema.migrate(db)
        report = await reconcile(db)
    finally:
        await db.close()
    print(render(report))
    return report.ok


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
    wk = sub.add_parser(
        "worker", help="run the arq worker against REDPACKET_REDIS_URL / REDPACKET_DATABASE_URL"
    )
    wk.add_argument(
        "--check", action="store_true", help="exit 0 if a worker reported healthy recently, else 1"
    )
    sub.add_parser("migrate", help="apply database migrations")
    sub.add_parser("reconcile", help="check every cent; print a report; exit 1 on any difference")
    blocks = sub.add_parser("blocks", help="list the users the bot detector blocked; --lift USER to unblock")
    blocks.add_argument("--lift", type=int, metavar="USER")
    rec = sub.add_parser("recover", help="rebuild packets' Redis state from the database")
    rec.add_argument("packet_ids", type=int, nargs="+")
    bench = sub.add_parser("bench", help="print benchmark figures and a JSON line")
    bench.add_argument("what", choices=["grab", "hub-grab", "fanout", "hot", "credit", "storm"])
    bench.add_argument("--grabs", type=int, default=20_000, help="grabs per measured mode (grab)")
    bench.add_argument("--clients", type=int, default=10_000, help="connected clients (hot)")
    args = parser.parse_args(argv)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # uvicorn drains on SIGTERM, then raises the signal again; end with a clean exit instead, so the
    # cleanup below (the embedded Valkey's shutdown) still runs.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    settings = Settings.from_env()
    if args.command in ("up", "serve"):
        if args.host:
            settings = settings.with_(host=args.host)
        if args.port is not None:
            settings = settings.with_(port=args.port)
    try:
        with _redis_url(settings) as s:
            if args.command == "up":
                uvloop.run(_serve(_demo_secret(s), with_worker=True))
            elif args.command == "serve":
                uvloop.run(_serve(s, with_worker=False))
            elif args.command == "worker":
                if args.check:
                    sys.exit(0 if uvloop.run(_worker_healthy(s)) else 1)
                uvloop.run(_worker(s))
            elif args.command == "migrate":
                uvloop.run(_migrate(s))
            elif args.command == "blocks":
                uvloop.run(_blocks(s, args.lift))
            elif args.command == "reconcile":
                if not uvloop.run(_reconcile(s)):
                    sys.exit(1)
            elif args.command == "recover":
                uvloop.run(_recover(s, args.packet_ids))
            elif args.command == "bench":
                from server import hubbench
                from server.bench import run_grab_bench

                if args.what == "grab":
                    uvloop.run(run_grab_bench(s, args.grabs))
                elif args.what == "hub-grab":
                    uvloop.run(hubbench.bench_hub_grab(s))
                elif args.what == "credit":
                    from server.creditbench import bench_credit

                    uvloop.run(bench_credit(s))
                elif args.what == "storm":
                    from server.creditbench import bench_storm

                    uvloop.run(bench_storm(s))
                elif args.what == "fanout":
                    uvloop.run(hubbench.bench_fanout(s))
                else:
                    uvloop.run(hubbench.bench_hot(s, args.clients))
    except KeyboardInterrupt:
        pass
    sys.exit(0)
