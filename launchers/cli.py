"""What ``python -m launchers.galera up DIR`` and ``python -m launchers.spider up DIR`` share: the command
line (how many servers, the first port, the database), the checks before anything starts, the servers
run until SIGINT or SIGTERM — either, while they are still starting, cancels the start — and the exit
code: 2 and one line on stderr for what the operator can fix, 1 and one line for a server that did not
come up."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from launchers.cluster import Cluster
from launchers.mariadbd import Tool, unenterable

C = TypeVar("C", bound=Cluster[Any])


@dataclass(frozen=True)
class Command(Generic[C]):
    """One tool's ``up DIR [--COUNT 3] [--port PORT] [--database redpacket]``: its ``cluster`` (given DIR,
    how many and their ports, ``ports_from(PORT, how many)``), what it prints once they are up (``ready``,
    given the cluster, the database and the seconds they took), and the text of its help and limits."""

    tool: Tool
    cluster: Callable[[Path, int, list[int]], AbstractAsyncContextManager[C]]
    ports_from: Callable[[int, int], list[int]]
    ready: Callable[[C, str, float], None]
    count: str  # the option for how many: "nodes" is --nodes
    most: int  # how many at the most
    limits: str  # said when --COUNT or --port is out of range
    port: int  # --port's default
    description: str  # the help of the command, of up, of --port, of --database
    up_help: str
    port_help: str
    database_help: str

    def parser(self) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(
            prog=f"python -m launchers.{self.tool.name}", description=self.description
        )
        sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
        start = sub.add_parser("up", help=self.up_help)
        where = f"where the {self.tool.members} keep their data"
        start.add_argument("directory", type=Path, metavar="DIR", help=where)
        start.add_argument(
            f"--{self.count}", dest="count", metavar=self.count.upper(), type=int, default=3,
            help=f"how many {self.count} (default 3)",
        )  # fmt: skip
        start.add_argument("--port", type=int, default=self.port, help=self.port_help)
        start.add_argument("--database", default="redpacket", help=self.database_help)
        return p

    def main(self, argv: list[str] | None = None) -> int:
        """``up`` run, as an exit code: 0 once SIGINT or SIGTERM stopped it; 2 and one line on stderr for a
        ``setup_error`` (out of the limits, a DIR the servers' user may not enter, a busy port, a program
        missing); 1 and one line for another ``error`` (a server that did not come up)."""
        args = self.parser().parse_args(argv)
        tool = self.tool
        try:
            if (
                not (1 <= args.count <= self.most and 1024 <= args.port)
                or max(self.ports_from(args.port, args.count)) >= 65_536
            ):
                raise tool.setup_error(self.limits)
            problem = unenterable(args.directory, tool.members, f"/var/tmp/{tool.name}")
            if problem:
                raise tool.setup_error(problem)
            with contextlib.suppress(asyncio.CancelledError):
                asyncio.run(self.serve(args.directory, args.count, args.port, args.database))
        except tool.error as e:
            print(f"{tool.name}: {e}", file=sys.stderr)
            return 2 if isinstance(e, tool.setup_error) else 1
        return 0

    async def serve(self, directory: Path, count: int, port: int, database: str) -> None:
        """The cluster, with ``database`` made on it (kept if it exists), until SIGINT or SIGTERM; either,
        while the servers are still starting, cancels the start."""
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        task = asyncio.current_task()
        up = False

        def on_signal() -> None:
            if task is not None and not stop.is_set() and not up:
                task.cancel()
            stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        started = time.monotonic()
        async with self.cluster(directory, count, self.ports_from(port, count)) as cluster:
            await cluster.create_database(database, replace=False)
            up = True
            self.ready(cluster, database, time.monotonic() - started)
            await stop.wait()
