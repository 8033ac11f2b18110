"""``redpacket bench``: which benchmark of ``bench`` each name runs, once the services answer
(docs/benchmarks.md; ``bench tokens``, pure CPU, needs neither and is run from ``server.cli``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from server.cli.errors import OperatorError
from server.cli.services import check_services
from server.settings import Settings


async def bench(settings: Settings, args: argparse.Namespace) -> None:
    from bench import hotbench, hubbench
    from bench.creditbench import bench_credit, bench_storm
    from bench.dbreadbench import run_db_read_bench
    from bench.grabbench import run_grab_bench

    what = args.what
    if args.spider:
        _spider_args(settings, args)  # (a mistake said before any service starts)
    if what == "storm":
        _storm_seconds(args)  # (a mistake said before any service starts)
    if what == "hot" and (problem := hotbench.room_problem(args.clients, args.hubs, args.workers)):
        raise OperatorError(problem, 2)
    if what == "credit" and not args.spider:
        _own_database(settings)
    await check_services(settings)
    plot = Path(args.plot) if args.plot else None
    if what == "grab":
        await run_grab_bench(settings, args.grabs, plot=plot)
    elif what == "db-read":
        await run_db_read_bench(settings, plot=plot)
    elif what == "hub-grab":
        await hubbench.bench_hub_grab(settings, workers=args.workers, plot=plot, seconds=args.seconds)
    elif what == "batcher":
        from bench.batchbench import bench_batcher

        await bench_batcher(settings)
    elif what == "flood":
        from bench.floodbench import bench_flood

        await bench_flood(settings, seconds=args.seconds or 15.0)
    elif args.spider:
        await _on_spider(settings, args, plot)
    elif what in ("credit", "storm") and args.galera:
        await _on_galera(settings, args, plot)
    elif what == "credit":
        await bench_credit(settings, plot=plot)
    elif what == "storm":
        await bench_storm(
            settings, args.rate, _storm_seconds(args), plot=plot, reconcile_at=args.reconcile_at
        )
    elif what == "fanout":
        await hubbench.bench_fanout(settings, plot=plot)
    elif what == "hook":
        from bench.hookbench import bench_hook

        await bench_hook(settings, plot=plot)
    else:
        await hotbench.bench_hot(
            settings,
            args.clients,
            workers=args.workers,
            client_procs=args.client_procs,
            hubs=args.hubs,
            plot=plot,
        )


def _own_database(settings: Settings) -> None:
    """``bench credit`` undoes its own packets' credits between phases, and its drain pays whatever the
    outboxes hold: it runs on a database of its own, ``bench`` in its name, or with none named (a
    throw-away SQLite file). A ledger in use, named by mistake, is refused before anything starts."""
    url = settings.database_url
    name = url.split("?", 1)[0].rstrip("/").rsplit("/", 1)[-1].lower()
    if url and "bench" not in name:
        raise OperatorError(
            "bench credit deletes and rewrites the credits of its own packets between its phases, and its"
            " drain pays any credit waiting in Redis: it runs only on a database of its own, with `bench` in"
            " its name (REDPACKET_DATABASE_URL=mysql://…/redpacket_bench), or with REDPACKET_DATABASE_URL"
            " unset (a throw-away SQLite file)",
            2,
        )


def _storm_seconds(args: argparse.Namespace) -> int:
    seconds = int(args.seconds or 30)
    if args.rate * seconds < 1000:
        raise OperatorError(
            "bench storm grabs packets of 1,000 shares: --rate × --seconds must be 1,000 or more", 2
        )
    return seconds


async def _on_galera(settings: Settings, args: argparse.Namespace, plot: Path | None) -> None:
    """``credit --galera`` / ``storm --galera``: beside the configured MariaDB, a cluster of its own."""
    from bench import galerabench
    from launchers.galera import GaleraSetupError

    if not settings.database_url.startswith(("mysql", "mariadb")):
        raise OperatorError("--galera compares with a MariaDB: set REDPACKET_DATABASE_URL=mysql://…", 2)
    try:
        if args.what == "credit":
            await galerabench.bench_credit_galera(settings, plot=plot)
        else:
            seconds = _storm_seconds(args)
            await galerabench.bench_storm_galera(
                settings, args.rate, seconds, args.kill_writer_after, plot=plot
            )
    except GaleraSetupError as e:
        raise OperatorError(f"cannot start the Galera cluster: {e}", 1) from None


def _spider_args(settings: Settings, args: argparse.Namespace) -> None:
    if args.what != "credit" or args.galera:
        raise OperatorError("--spider is for bench credit, without --galera", 2)
    if not settings.database_url.startswith(("mysql", "mariadb")):
        raise OperatorError("--spider compares with a MariaDB: set REDPACKET_DATABASE_URL=mysql://…", 2)
    if args.rounds < 1 or args.credits < 1:
        raise OperatorError("bench credit --spider needs --rounds and --credits of 1 or more", 2)


async def _on_spider(settings: Settings, args: argparse.Namespace, plot: Path | None) -> None:
    """``credit --spider``: beside the configured MariaDB, a Spider head over 1, 2 and 3 backends."""
    from bench import spiderbench
    from launchers.spider import SpiderSetupError

    try:
        await spiderbench.bench_credit_spider(settings, args.rounds, args.credits, plot=plot)
    except SpiderSetupError as e:
        raise OperatorError(f"cannot start the Spider cluster: {e}", 2) from None
