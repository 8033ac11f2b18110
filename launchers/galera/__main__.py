"""``python -m launchers.galera up DIR``: a Galera cluster on this machine until Ctrl-C or SIGTERM.

It prints the cluster's URL (every node: ``mysql://root@127.0.0.1:P1,.../redpacket``) on one line of
stdout once every node is Synced, then stops every node cleanly on the way out. The data stays in DIR: a
second ``up`` on it starts the same cluster again. What the operator can fix (a busy port, mariadbd or
Galera missing, a DIR the nodes cannot use) is one line on stderr and exit code 2; a node that does not
come up is one line and exit code 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import time
from pathlib import Path

from launchers.galera.cluster import galera_cluster, ports_from
from launchers.galera.node import GaleraError, GaleraSetupError
from launchers.mariadbd import unenterable


async def up(directory: Path, nodes: int, port: int, database: str) -> None:
    """Until SIGINT or SIGTERM; either, while the nodes are still starting, cancels the start."""
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
    async with galera_cluster(directory, nodes, ports_from(port, nodes)) as cluster:
        await cluster.create_database(database, replace=False)
        ready = True
        print(cluster.url(database), flush=True)
        took = time.monotonic() - started
        print(
            f"galera: {nodes} node(s) Synced in {took:.1f} s; Ctrl-C stops them", file=sys.stderr, flush=True
        )
        await stop.wait()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m launchers.galera", description="A Galera cluster on this machine."
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    start = sub.add_parser("up", help="start the nodes, print their URL, run until Ctrl-C or SIGTERM")
    start.add_argument("directory", type=Path, metavar="DIR", help="where the nodes keep their data")
    start.add_argument("--nodes", type=int, default=3, help="how many nodes (default 3)")
    start.add_argument(
        "--port", type=int, default=33061,
        help="node 0's SQL port (default 33061); node i's is PORT+i, then 3 Galera ports a node above them",
    )  # fmt: skip
    start.add_argument(
        "--database", default="redpacket", help="made if missing; the URL's (default redpacket)"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if not 1 <= args.nodes <= 9 or not 1024 <= args.port <= 65_536 - 4 * args.nodes:
            raise GaleraSetupError("--nodes is 1 to 9, and --port leaves 4 ports a node below 65536")
        problem = unenterable(args.directory, "nodes", "/var/tmp/galera")
        if problem:
            raise GaleraSetupError(problem)
        with contextlib.suppress(asyncio.CancelledError):
            asyncio.run(up(args.directory, args.nodes, args.port, args.database))
    except GaleraSetupError as e:
        print(f"galera: {e}", file=sys.stderr)
        return 2
    except GaleraError as e:
        print(f"galera: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
