"""``redpacket bench``: which benchmark of ``server.tools`` each name runs, once the services answer
(docs/benchmarks.md; ``bench tokens``, pure CPU, needs neither and is run from ``server.cli``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from server.cli.services import check_services
from server.settings import Settings


async def bench(settings: Settings, args: argparse.Namespace) -> None:
    from server.tools import galerabench, hotbench, hubbench
    from server.tools.bench import run_grab_bench
    from server.tools.creditbench import bench_credit, bench_storm
    from server.tools.dbreadbench import run_db_read_bench

    await check_services(settings)
    what = args.what
    plot = Path(args.plot) if args.plot else None
    if what == "grab":
        await run_grab_bench(settings, args.grabs, plot=plot)
    elif what == "db-read":
        await run_db_read_bench(settings, plot=plot)
    elif what == "hub-grab":
        await hubbench.bench_hub_grab(settings, workers=args.workers, plot=plot, seconds=args.seconds)
    elif what == "credit" and args.galera:
        await galerabench.bench_credit_galera(settings, plot=plot)
    elif what == "credit":
        await bench_credit(settings, plot=plot)
    elif what == "storm" and args.galera:
        seconds = int(args.seconds or 30)
        await galerabench.bench_storm_galera(settings, args.rate, seconds, args.kill_writer_after, plot=plot)
    elif what == "storm":
        await bench_storm(settings, args.rate, int(args.seconds or 30), plot=plot)
    elif what == "fanout":
        await hubbench.bench_fanout(settings, plot=plot)
    else:
        await hotbench.bench_hot(
            settings, args.clients, workers=args.workers, client_procs=args.client_procs, plot=plot
        )
