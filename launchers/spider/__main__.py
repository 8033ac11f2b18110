"""``python -m launchers.spider up DIR``: a Spider head and its backends on this machine until Ctrl-C
or SIGTERM.

Once every server answers and the database is made on each (kept if it exists), stdout gets one
comment line per server (``# head 127.0.0.1:33071 pid 4242 log DIR/head.err``), then the two settings
to export::

    REDPACKET_DATABASE_URL=mysql://root@127.0.0.1:33071/redpacket
    REDPACKET_SHARDS=mysql://root@127.0.0.1:33072/redpacket,mysql://root@127.0.0.1:33073/redpacket,...

(so stdout, saved to a file, can be sourced by a shell). On the way out every server is stopped cleanly.
The data stays in DIR: a second ``up`` on it starts the same servers again. What the operator can fix
(a busy port, mariadbd or the Spider plugin missing, a DIR the servers cannot use) is one line on
stderr and exit code 2; a server that does not come up is one line and exit code 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import time
from pathlib import Path

from launchers.mariadbd import unenterable
from launchers.spider.cluster import ports_from, spider_cluster
from launchers.spider.node import SpiderError, SpiderSetupError

BASE_PORT = 33071  # the Galera tool's nodes take 33061 and up


async def up(directory: Path, backends: int, port: int, database: str) -> None:
    """Until SIGINT or SIGTERM; either, while the servers are still starting, cancels the start."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    task = asyncio.current_task()
    ready = False

    def on_signal() -> None:
        if task is not None and not stop.is_set() and not ready:
            task.cancel()
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    started = time.monotonic()
    async with spider_cluster(directory, backends, ports_from(port, backends)) as cluster:
        await cluster.create_database(database, replace=False)
        ready = True
        for node in cluster.nodes:
            print(f"# {node.name} {node.address} pid {node.pid} log {node.log}")
        print(f"REDPACKET_DATABASE_URL={cluster.head_url(database)}")
        print(f"REDPACKET_SHARDS={cluster.shards_setting(database)}", flush=True)
        took = time.monotonic() - started
        print(
            f"spider: a head and {backends} backend(s) up in {took:.1f} s; Ctrl-C stops them",
            file=sys.stderr, flush=True,
        )  # fmt: skip
        await stop.wait()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m launchers.spider", description="A Spider head and its backends on this machine."
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    start = sub.add_parser(
        "up", help="start the servers, print the settings to export, run until Ctrl-C or SIGTERM"
    )
    start.add_argument("directory", type=Path, metavar="DIR", help="where the servers keep their data")
    start.add_argument("--backends", type=int, default=3, help="how many backends (default 3)")
    start.add_argument(
        "--port", type=int, default=BASE_PORT,
        help=f"the head's port (default {BASE_PORT}); backend i's is PORT+1+i",
    )  # fmt: skip
    start.add_argument(
        "--database", default="redpacket", help="made on every server if missing (default redpacket)"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if not 1 <= args.backends <= 64 or not 1024 <= args.port <= 65_535 - args.backends:
            raise SpiderSetupError("--backends is 1 to 64, and --port leaves a port a backend below 65536")
        problem = unenterable(args.directory, "servers", "/var/tmp/spider")
        if problem:
            raise SpiderSetupError(problem)
        with contextlib.suppress(asyncio.CancelledError):
            asyncio.run(up(args.directory, args.backends, args.port, args.database))
    except SpiderSetupError as e:
        print(f"spider: {e}", file=sys.stderr)
        return 2
    except SpiderError as e:
        print(f"spider: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
