"""The head and its backends together: their ports and directory, their URLs, starting them and waiting
for each, a database on all, and stopping them all."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

from launchers import mariadbd
from launchers.mariadbd import blocked_for, hand_over, node_user, pick_ports, port_free
from launchers.spider.node import PLUGIN, SpiderError, SpiderNode, SpiderSetupError, program


def ports_from(base: int, backends: int) -> list[int]:
    """The head's port ``base``, then backend i's ``base + 1 + i``."""
    return [base + i for i in range(backends + 1)]


class SpiderCluster:
    """A Spider ``head`` and ``backends`` under ``base_dir`` — or, when the servers' user may not enter
    it, under a temp dir of their own (``home`` says which; the package's docstring why); ``ports`` the
    head's then each backend's, else picked free."""

    def __init__(self, base_dir: Path, backends: int = 3, ports: list[int] | None = None) -> None:
        ports = pick_ports(backends + 1) if ports is None else ports
        if backends < 1 or len(ports) != backends + 1:
            raise SpiderSetupError(
                f"a head and {backends} backend(s) need {backends + 1} ports, not {len(ports)}"
            )
        self.user = node_user()
        self.temporary: Path | None = None
        home = base_dir.resolve()
        if self.user is not None and blocked_for(self.user, home) is not None:
            self.temporary = home = Path(tempfile.mkdtemp(prefix="redpacket-spider-"))
        self.home = home
        name = self.user.pw_name if self.user is not None and os.geteuid() == 0 else None
        self.head = SpiderNode("head", ports[0], home, name, head=True)
        self.backends = [SpiderNode(f"backend{i}", port, home, name) for i, port in enumerate(ports[1:])]

    @property
    def nodes(self) -> list[SpiderNode]:
        """The head, then the backends."""
        return [self.head, *self.backends]

    def head_url(self, database: str) -> str:
        """``mysql://root@127.0.0.1:PORT/database``: the head, where the Spider tables are."""
        return self.head.url(database)

    def backend_urls(self, database: str) -> list[str]:
        """Each backend's URL, in order: backend i holds partition i."""
        return [backend.url(database) for backend in self.backends]

    def shards_setting(self, database: str) -> str:
        """The backends' URLs joined by ``,``: the value of ``REDPACKET_SHARDS``."""
        return ",".join(self.backend_urls(database))

    def _prepare(self) -> None:
        """What can be checked before anything starts, and the directory."""
        if os.geteuid() == 0 and self.user is None:
            raise SpiderSetupError("run as root, the servers run as the mysql user, and there is none")
        for name in ("mariadbd", "mariadb-install-db"):
            program(name)
        if not PLUGIN.exists():
            raise SpiderSetupError(f"no Spider plugin at {PLUGIN} (apt-get install mariadb-plugin-spider)")
        for node in self.nodes:
            if node.running:
                raise SpiderError(f"{node.name} runs already: start() is for stopped servers")
            if not port_free(node.port):
                raise SpiderSetupError(f"port {node.port} ({node.name}) is in use: choose other ports")
        try:
            self.home.mkdir(parents=True, exist_ok=True)
            for node in self.nodes:
                node.tmpdir.mkdir(exist_ok=True)
            hand_over(self.home, self.user)
        except OSError as e:
            raise SpiderSetupError(f"the servers cannot use {self.home}: {e}") from e

    async def start(self) -> None:
        """Install the data directories that are empty and start every server, side by side; returns when
        each answers ``SELECT 1`` (and the head has its Spider engine). On a failure or cancellation,
        every server started is stopped."""
        self._prepare()
        try:
            for failed in await asyncio.gather(*(n.start() for n in self.nodes), return_exceptions=True):
                if failed is not None:
                    raise failed
        except BaseException:
            await asyncio.shield(self._stop_all())
            raise

    async def create_database(self, name: str, *, replace: bool = True) -> None:
        """Database ``name`` (utf8mb4) on the head and on every backend; an existing one is dropped first
        unless not ``replace``. No table, no ``CREATE SERVER``: the ledger's migrations make those."""
        await asyncio.gather(*(mariadbd.create_database(n.port, name, replace=replace) for n in self.nodes))

    async def _stop_all(self) -> None:
        await asyncio.gather(*(node.stop() for node in self.nodes))

    async def close(self) -> None:
        """Stop every server (cleanly; SIGKILL after 30 s), and remove the temp dir if one was made — the
        data under a ``base_dir`` given stays. Cancelled, it kills the servers it has not stopped yet."""
        try:
            await asyncio.shield(self._stop_all())
        finally:
            for node in self.nodes:
                node.kill()
            if self.temporary is not None:
                shutil.rmtree(self.temporary, ignore_errors=True)


@contextlib.asynccontextmanager
async def spider_cluster(
    base_dir: Path, backends: int = 3, ports: list[int] | None = None
) -> AsyncIterator[SpiderCluster]:
    """A head and ``backends`` started, each answering, closed on the way out."""
    cluster = SpiderCluster(base_dir, backends, ports)
    try:
        await cluster.start()
        yield cluster
    finally:
        await cluster.close()
