"""One ``mariadbd`` of a launcher, whatever its part (a Galera node, a Spider head or backend): its files in
the launcher's directory, installing its data directory, starting it on that directory and its port,
waiting until it answers, pausing, killing and stopping it, and its log. ``galera.node`` and
``spider.node`` add their options and what they wait for."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import ClassVar

from launchers.mariadbd import Tool, answers, finish, log_tail, port_free


class Node(ABC):
    """One ``mariadbd`` named ``name``, of a ``tool``: in ``home`` its data directory (``name``), log
    (``name.err``) and temp dir (``name.tmp``); ``port`` its SQL port; ``user`` who it runs as (given when
    we are root), ``label`` what messages call it (by default its name). ``pid`` is None unless it runs.

    ``kill`` is a crash (SIGKILL), ``pause`` a hung machine (SIGSTOP: the process stays but answers
    nobody), ``stop`` a clean shutdown (SIGTERM)."""

    tool: ClassVar[Tool]

    def __init__(self, name: str, port: int, home: Path, user: str | None, label: str = "") -> None:
        self.name = name
        self.label = label or name
        self.port = port
        self.home = home
        self.user = user
        self.datadir = home / name
        self.log = home / f"{name}.err"
        # Its own temp dir: servers sharing /tmp clashed on temporary table names (mariadb-install-db run
        # side by side failed one time in three: "Unknown table 'mysql.tmp_user_sys'").
        self.tmpdir = home / f"{name}.tmp"
        self.paused = False
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def ports(self) -> tuple[int, ...]:
        """Every port it listens on: its SQL port, and those of a subclass."""
        return (self.port,)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    @property
    def running(self) -> bool:
        return self.pid is not None

    def url(self, database: str) -> str:
        """``mysql://root@127.0.0.1:PORT/database``."""
        return f"mysql://root@{self.address}/{database}"

    def log_tail(self, lines: int = 8) -> str:
        return log_tail(self.log, lines)

    def check_ports(self) -> None:
        """A ``setup_error`` when one of its ports is in use."""
        for port in self.ports:
            if not port_free(port):
                raise self.tool.setup_error(f"port {port} ({self.label}) is in use: choose other ports")

    def lay_out(self) -> None:
        """Its files that must be there before it is installed or started: its temp dir."""
        self.tmpdir.mkdir(exist_ok=True)

    @abstractmethod
    def install_options(self) -> list[str]:
        """``mariadb-install-db``'s options: first where they come from (``--defaults-file`` or
        ``--no-defaults``), then those it passes on to ``mariadbd``."""

    async def install(self) -> None:
        """``mariadb-install-db`` into an empty data directory (nothing when it holds a database): root
        at 127.0.0.1 over TCP with no password."""
        if (self.datadir / "mysql").is_dir():
            return
        done = await asyncio.create_subprocess_exec(
            self.tool.program("mariadb-install-db"), *self.install_options(), "--skip-test-db",
            "--auth-root-authentication-method=normal",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        out, _ = await finish(done)
        if done.returncode != 0:
            said = " | ".join(out.decode(errors="replace").strip().splitlines()[-5:])
            raise self.tool.error(f"{self.label}: mariadb-install-db failed: {said}")

    def _check_stopped(self) -> None:
        """An ``error`` when it runs, a ``setup_error`` when one of its ports is in use."""
        if self.running:
            raise self.tool.error(f"{self.label} runs already (pid {self.pid})")
        self.check_ports()

    def _spawn(self, options: list[str]) -> None:
        """``mariadbd`` started with ``options``, not paused; does not wait for it."""
        args = [self.tool.program("mariadbd"), *options]
        self.paused = False
        # A session of its own: a terminal's Ctrl-C reaches the launcher alone, which stops the servers.
        self._proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )

    async def wait_ready(self, timeout: float = 60) -> None:
        """Until it answers ``SELECT 1``; raises with its log's last lines on timeout, or at once when its
        process has ended."""
        await self._wait(
            lambda: answers(self.port), lambda: f"{self.label} (port {self.port}) silent for {timeout:.0f} s",
            timeout,
        )  # fmt: skip

    async def _wait(
        self, ready: Callable[[], Awaitable[bool]], late: Callable[[], str], timeout: float
    ) -> None:
        """Until ``ready()`` (asked every 0.1 s); an ``error`` with its log's last lines at once when its
        process has ended, or saying ``late()`` after ``timeout``."""
        deadline = time.monotonic() + timeout
        while not await ready():
            if not self.running:
                raise self.tool.error(f"{self.label} (port {self.port}) exited: {self.log_tail()}")
            if time.monotonic() > deadline:
                raise self.tool.error(f"{late()}: {self.log_tail()}")
            await asyncio.sleep(0.1)

    def _signal(self, sig: signal.Signals) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL, as a crash; returns once the process is reaped."""
        if self._proc is not None:
            self._signal(signal.SIGKILL)
            self._proc.wait()
        self.paused = False

    def pause(self) -> None:
        """SIGSTOP: the process stays but answers nobody (a hung machine)."""
        self._signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        """SIGCONT after ``pause``."""
        self._signal(signal.SIGCONT)
        self.paused = False

    async def stop(self, timeout: float = 30) -> None:
        """SIGTERM (a clean shutdown) and wait; SIGKILL after ``timeout``. Cancelled, the process runs
        on: ``kill`` it."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        self._signal(signal.SIGCONT)
        self._signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            await asyncio.to_thread(proc.wait, timeout)
        self.kill()
