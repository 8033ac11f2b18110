"""A launcher's ``mariadbd`` servers together, whatever they are (Galera nodes, a Spider head and its
backends): where they live — the directory given or, when the user they run as may not enter it, a temp
dir of their own — the checks before any of them starts, starting them with every one stopped again on a
failure or cancellation, and closing. ``galera.cluster`` and ``spider.cluster`` add the order they start
in and what they are together."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

from launchers.mariadbd import Tool, blocked_for, hand_over, node_user
from launchers.node import Node

N = TypeVar("N", bound=Node)
C = TypeVar("C", bound="Cluster[Any]")


class Cluster(ABC, Generic[N]):
    """The ``nodes`` of a ``tool`` (a subclass makes them, in ``home``): under ``base_dir`` or, when their
    user may not enter it, under a temp dir of their own (``temporary``, removed at ``close``). ``run_as``
    is that user's name when we are root (``mariadbd`` drops to it), else None."""

    tool: ClassVar[Tool]
    stopped: ClassVar[str]  # what start() is for, said when a server runs: "a stopped cluster"
    nodes: list[N]

    def __init__(self, base_dir: Path) -> None:
        self.user = node_user()
        self.temporary: Path | None = None
        home = base_dir.resolve()
        if self.user is not None and blocked_for(self.user, home) is not None:
            self.temporary = home = Path(tempfile.mkdtemp(prefix=f"redpacket-{self.tool.name}-"))
        self.home = home
        self.run_as = self.user.pw_name if self.user is not None and os.geteuid() == 0 else None

    def _prepare(self) -> None:
        """What can be checked before anything starts, and the directory with each server's files."""
        members = self.tool.members
        if os.geteuid() == 0 and self.user is None:
            raise self.tool.setup_error(
                f"run as root, the {members} run as the mysql user, and there is none"
            )
        self.tool.check_installed()
        for node in self.nodes:
            if node.running:
                raise self.tool.error(f"{node.label} runs already: start() is for {self.stopped}")
            node.check_ports()
        try:
            self.home.mkdir(parents=True, exist_ok=True)
            for node in self.nodes:
                node.lay_out()
            hand_over(self.home, self.user)
        except OSError as e:
            raise self.tool.setup_error(f"the {members} cannot use {self.home}: {e}") from e

    async def start(self) -> None:
        """Check what can be before anything starts and lay out the directory, then start the servers
        (``_start``: in the tool's order, each waited for as the tool says). On a failure or cancellation,
        every server started is stopped."""
        self._prepare()
        try:
            await self._start()
        except BaseException:
            await asyncio.shield(self._stop_all())
            raise

    @abstractmethod
    async def _start(self) -> None: ...

    @abstractmethod
    async def create_database(self, name: str, *, replace: bool = True) -> None:
        """Database ``name`` (utf8mb4) where the tool's clients use it; an existing one is dropped first
        unless not ``replace``."""

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
async def started(make: Callable[[], C]) -> AsyncIterator[C]:
    """The cluster ``make()`` returns (made on entering, not before) started, and closed on the way out."""
    cluster = make()
    try:
        await cluster.start()
        yield cluster
    finally:
        await cluster.close()
