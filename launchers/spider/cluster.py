"""The head and its backends together (``launchers.cluster``): their ports, their URLs, starting them and
waiting for each, and a database on all."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from launchers import mariadbd
from launchers.cluster import Cluster, started
from launchers.mariadbd import pick_ports, together
from launchers.spider.node import SPIDER, SpiderNode, SpiderSetupError


def ports_from(base: int, backends: int) -> list[int]:
    """The head's port ``base``, then backend i's ``base + 1 + i``."""
    return [base + i for i in range(backends + 1)]


class SpiderCluster(Cluster[SpiderNode]):
    """A Spider ``head`` and ``backends`` under ``base_dir`` — or, when the servers' user may not enter
    it, under a temp dir of their own (``home`` says which; the package's docstring why); ``ports`` the
    head's then each backend's, else picked free. ``nodes`` are the head, then the backends."""

    tool = SPIDER
    stopped = "stopped servers"

    def __init__(self, base_dir: Path, backends: int = 3, ports: list[int] | None = None) -> None:
        ports = pick_ports(backends + 1) if ports is None else ports
        if backends < 1 or len(ports) != backends + 1:
            raise SpiderSetupError(
                f"a head and {backends} backend(s) need {backends + 1} ports, not {len(ports)}"
            )
        super().__init__(base_dir)
        self.head = SpiderNode("head", ports[0], self.home, self.run_as, head=True)
        self.backends = [
            SpiderNode(f"backend{i}", port, self.home, self.run_as) for i, port in enumerate(ports[1:])
        ]
        self.nodes = [self.head, *self.backends]

    def head_url(self, database: str) -> str:
        """``mysql://root@127.0.0.1:PORT/database``: the head, where the Spider tables are."""
        return self.head.url(database)

    def backend_urls(self, database: str) -> list[str]:
        """Each backend's URL, in order: backend i holds partition i."""
        return [backend.url(database) for backend in self.backends]

    def shards_setting(self, database: str) -> str:
        """The backends' URLs joined by ``,``: the value of ``REDPACKET_SHARDS``."""
        return ",".join(self.backend_urls(database))

    async def _start(self) -> None:
        """Install the data directories that are empty and start every server, side by side; returns when
        each answers ``SELECT 1`` (and the head has its Spider engine)."""
        await together(*(n.start() for n in self.nodes))

    async def create_database(self, name: str, *, replace: bool = True) -> None:
        """Database ``name`` (utf8mb4) on the head and on every backend; an existing one is dropped first
        unless not ``replace``. No table, no ``CREATE SERVER``: the ledger's migrations make those."""
        await asyncio.gather(*(mariadbd.create_database(n.port, name, replace=replace) for n in self.nodes))


def spider_cluster(
    base_dir: Path, backends: int = 3, ports: list[int] | None = None
) -> contextlib.AbstractAsyncContextManager[SpiderCluster]:
    """A head and ``backends`` started, each answering, closed on the way out."""
    return started(lambda: SpiderCluster(base_dir, backends, ports))
