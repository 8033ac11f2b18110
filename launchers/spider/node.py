"""One server of the sharded database — the Spider head or a backend: its options, and its ``mariadbd``
process (``launchers.node``: started and waited for, paused, killed, stopped), the head's with its
Spider engine checked."""

from __future__ import annotations

from pathlib import Path

from launchers.mariadbd import Tool, fetch
from launchers.node import Node

PLUGIN = Path("/usr/lib/mysql/plugin/ha_spider.so")

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


SPIDER = Tool(
    "spider", "servers", SpiderError, SpiderSetupError, ("mariadbd", "mariadb-install-db"),
    "apt-get install mariadb-server mariadb-plugin-spider", PLUGIN, "Spider plugin", "mariadb-plugin-spider",
)  # fmt: skip
program = SPIDER.program  # the path of mariadbd or mariadb-install-db, or a SpiderSetupError


class SpiderNode(Node):
    """One ``mariadbd``: ``name`` is ``head`` or ``backendN``, ``port`` its SQL port; its data directory,
    socket, pid file and log (``name.err``) are in ``home``. ``pid`` is None unless it runs. Killed, the
    next ``start`` recovers InnoDB; paused, the head's connection to it times out (2 s to connect, 10 s
    to read)."""

    tool = SPIDER

    def __init__(self, name: str, port: int, home: Path, user: str | None, *, head: bool = False) -> None:
        super().__init__(name, port, home, user)
        self.head = head

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

    def install_options(self) -> list[str]:
        return ["--no-defaults", *self._files(), *COMMON]

    async def start(self, timeout: float = 60) -> None:
        """Install the data directory if it is empty, start the process and wait until it answers
        ``SELECT 1`` (after a kill, InnoDB's crash recovery first) — the head until its Spider engine is
        there too. Raises with its log's last lines when it ends or does not answer in ``timeout``;
        cancelled, or failing, the process is killed."""
        self._check_stopped()
        await self.install()
        self._spawn(self.options())
        try:
            await self.wait_ready(timeout)
            if self.head:
                await self._check_spider()
        except BaseException:
            self.kill()
            raise

    async def _check_spider(self) -> None:
        found = await fetch(
            self.port, "SELECT SUPPORT FROM information_schema.ENGINES WHERE ENGINE = 'SPIDER'"
        )
        if not found or found[0][0] not in ("YES", "DEFAULT"):
            raise SpiderError(f"{self.name} has no Spider engine ({found}): {self.log_tail()}")
