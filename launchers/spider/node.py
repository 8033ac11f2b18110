"""One server of the sharded database — the Spider head or a backend: its options, its ``mariadbd``
process (started and waited for, paused, killed, stopped) and its log."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import time
from pathlib import Path

import aiomysql

from launchers.mariadbd import answers, finish, log_tail, port_free, which

PLUGIN = Path("/usr/lib/mysql/plugin/ha_spider.so")
INSTALL_HINT = "apt-get install mariadb-server mariadb-plugin-spider"

# What every server is given (the system's /etc/mysql/my.cnf is never read): the same character set on
# all (without the system's file the default is latin1), a small buffer pool, no binary log.
COMMON = (
    "--skip-name-resolve",
    "--skip-log-bin",
    "--max-connections=300",  # a backend serves one connection per head connection that touched it
    "--character-set-server=utf8mb4",
    "--collation-server=utf8mb4_general_ci",
    "--default-storage-engine=InnoDB",
    "--innodb-buffer-pool-size=32M",
    "--innodb-log-file-size=16M",
)

# The head loads Spider; a backend that does not answer (killed, or paused: SIGSTOP) holds a head's
# thread for 2 s at connect and 10 s mid-query, not the default 600 s, and is tried once, not 1000 times.
# Auto-increment ids come from the head's own counter (mode 1, started past every backend's largest id):
# unique over the shards, and no lock on the backends (the default, 0, locks the backend's table for an
# insert, so an insert waits for another shard's open insert: server.store.shards says more).
HEAD = (
    "--plugin-load-add=ha_spider.so",
    "--spider-auto-increment-mode=1",
    "--spider-connect-timeout=2",
    "--spider-net-read-timeout=10",
    "--spider-net-write-timeout=10",
    "--spider-connect-retry-count=1",
)


class SpiderError(RuntimeError):
    """A server did not come up, the head has no Spider engine, or a server died; the message says which
    and what its log said."""


class SpiderSetupError(SpiderError):
    """Something the operator can fix before anything starts: a busy port, a missing program or plugin,
    a directory."""


def program(name: str) -> str:
    """The path of ``mariadbd`` or ``mariadb-install-db``."""
    found = which(name)
    if found is None:
        raise SpiderSetupError(f"{name} is not installed ({INSTALL_HINT})")
    return found


class SpiderNode:
    """One ``mariadbd``: ``name`` is ``head`` or ``backendN``, ``port`` its SQL port; its data directory,
    socket, pid file and log (``name.err``) are in ``home``. ``pid`` is None unless it runs."""

    def __init__(self, name: str, port: int, home: Path, user: str | None, *, head: bool = False) -> None:
        self.name = name
        self.port = port
        self.home = home
        self.user = user
        self.head = head
        self.datadir = home / name
        self.log = home / f"{name}.err"
        # Its own temp dir: servers sharing /tmp clashed on temporary table names (mariadb-install-db run
        # side by side, as the Galera tool found).
        self.tmpdir = home / f"{name}.tmp"
        self.paused = False
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    @property
    def running(self) -> bool:
        return self.pid is not None

    def url(self, database: str) -> str:
        """``mysql://root@127.0.0.1:PORT/database``."""
        return f"mysql://root@{self.address}/{database}"

    def _files(self) -> list[str]:
        user = [f"--user={self.user}"] if self.user else []
        return [*user, f"--datadir={self.datadir}", f"--tmpdir={self.tmpdir}"]

    def options(self) -> list[str]:
        """``mariadbd``'s arguments after the program (``--no-defaults`` first, as it must be)."""
        return [
            "--no-defaults", *self._files(), f"--port={self.port}", "--bind-address=127.0.0.1",
            f"--socket={self.home / self.name}.sock", f"--pid-file={self.home / self.name}.pid",
            f"--log-error={self.log}", *COMMON, *(HEAD if self.head else ()),
        ]  # fmt: skip

    def log_tail(self, lines: int = 8) -> str:
        return log_tail(self.log, lines)

    async def install(self) -> None:
        """``mariadb-install-db`` into an empty data directory (nothing when it holds a database): root
        at 127.0.0.1 over TCP with no password."""
        if (self.datadir / "mysql").is_dir():
            return
        done = await asyncio.create_subprocess_exec(
            program("mariadb-install-db"), "--no-defaults", *self._files(), "--skip-test-db",
            "--auth-root-authentication-method=normal", *COMMON,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        out, _ = await finish(done)
        if done.returncode != 0:
            said = " | ".join(out.decode(errors="replace").strip().splitlines()[-5:])
            raise SpiderError(f"{self.name}: mariadb-install-db failed: {said}")

    async def start(self, timeout: float = 60) -> None:
        """Install the data directory if it is empty, start the process and wait until it answers
        ``SELECT 1`` (after a kill, InnoDB's crash recovery first) — the head until its Spider engine is
        there too. Raises with its log's last lines when it ends or does not answer in ``timeout``;
        cancelled, or failing, the process is killed."""
        if self.running:
            raise SpiderError(f"{self.name} runs already (pid {self.pid})")
        if not port_free(self.port):
            raise SpiderSetupError(f"port {self.port} ({self.name}) is in use: choose other ports")
        await self.install()
        self.paused = False
        self._proc = self._spawn([program("mariadbd"), *self.options()])
        try:
            await self.wait_ready(timeout)
            if self.head:
                await self._check_spider()
        except BaseException:
            self.kill()
            raise

    def _spawn(self, args: list[str]) -> subprocess.Popen[bytes]:
        # A session of its own: a terminal's Ctrl-C reaches the launcher alone, which stops the servers.
        return subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )

    async def wait_ready(self, timeout: float = 60) -> None:
        """Until it answers ``SELECT 1``; raises with its log's last lines on timeout, or at once when its
        process has ended."""
        deadline = time.monotonic() + timeout
        while not await answers(self.port):
            if not self.running:
                raise SpiderError(f"{self.name} (port {self.port}) exited: {self.log_tail()}")
            if time.monotonic() > deadline:
                raise SpiderError(
                    f"{self.name} (port {self.port}) silent for {timeout:.0f} s: {self.log_tail()}"
                )
            await asyncio.sleep(0.1)

    async def _check_spider(self) -> None:
        conn = await aiomysql.connect(host="127.0.0.1", port=self.port, user="root", connect_timeout=5)
        try:
            async with conn.cursor() as cur:
                await cur.execute("SELECT SUPPORT FROM information_schema.ENGINES WHERE ENGINE = 'SPIDER'")
                found = await cur.fetchall()
        finally:
            conn.close()
        if not found or found[0][0] not in ("YES", "DEFAULT"):
            raise SpiderError(f"{self.name} has no Spider engine ({found}): {self.log_tail()}")

    def _signal(self, sig: signal.Signals) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL, as a crash (the next ``start`` recovers InnoDB); returns once the process is reaped."""
        if self._proc is not None:
            self._signal(signal.SIGKILL)
            self._proc.wait()
        self.paused = False

    def pause(self) -> None:
        """SIGSTOP: the process stays but answers nobody (a hung machine): the head's connection to it
        times out (2 s to connect, 10 s to read)."""
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
