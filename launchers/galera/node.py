"""One Galera node: its option file, its ``mariadbd`` process (``launchers.node``: started, paused, killed,
stopped) started from the position a crash left, and what it says about itself (``wsrep_*`` status)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import aiomysql

from launchers.mariadbd import Tool, fetch, finish
from launchers.node import Node

PROVIDER = Path("/usr/lib/galera/libgalera_smm.so")

# The node's options; the evs timeouts drop a silent node in ~3 s (keepalive under a third of suspect).
OPTIONS = """\
[mysqld]
{user}datadir={datadir}
socket={home}/node{i}.sock
pid-file={home}/node{i}.pid
tmpdir={home}/node{i}.tmp
log-error={log}
port={port}
bind-address=127.0.0.1
skip-name-resolve
max_connections=200
character-set-server=utf8mb4
collation-server=utf8mb4_general_ci
default_storage_engine=InnoDB
binlog_format=ROW
innodb_autoinc_lock_mode=2
innodb_buffer_pool_size=32M
innodb_log_file_size=16M
wsrep_on=ON
wsrep_provider={provider}
wsrep_cluster_name=redpacket
wsrep_node_name=node{i}
wsrep_cluster_address=gcomm://{peers}
wsrep_node_address=127.0.0.1:{gcomm}
wsrep_provider_options="gmcast.listen_addr=tcp://127.0.0.1:{gcomm};ist.recv_addr=127.0.0.1:{ist};\
gcache.size=32M;evs.keepalive_period=PT0.5S;evs.suspect_timeout=PT2S;evs.inactive_timeout=PT3S"
wsrep_sst_receive_address=127.0.0.1:{sst}
wsrep_sst_method=rsync
"""


class GaleraError(RuntimeError):
    """A node did not come up, did not sync, or died; the message says which and what its log said."""


class GaleraSetupError(GaleraError):
    """Something the operator can fix before anything starts: a busy port, a missing program, a directory."""


GALERA = Tool(
    "galera", "nodes", GaleraError, GaleraSetupError, ("mariadbd", "mariadb-install-db", "rsync"),
    "apt-get install mariadb-server galera-4 rsync", PROVIDER, "Galera library", "galera-4",
)  # fmt: skip
program = GALERA.program  # the path of mariadbd, mariadb-install-db or rsync, or a GaleraSetupError


def grastate(datadir: Path) -> dict[str, str]:
    """``grastate.dat`` (Galera's saved position: uuid, seqno, safe_to_bootstrap); {} before a first run."""
    try:
        text = (datadir / "grastate.dat").read_text()
    except FileNotFoundError:
        return {}
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in text.splitlines()) if v}


def synced(status: dict[str, str]) -> bool:
    return (
        status.get("wsrep_local_state_comment") == "Synced"
        and status.get("wsrep_cluster_status") == "Primary"
    )


class GaleraNode(Node):
    """One ``mariadbd`` of the cluster (``nodeN``): ``port`` is its SQL port. Killed, its ``grastate.dat``
    keeps seqno -1 (``recovered_position`` finds where it was); paused, the others drop it ~3 s on; a
    joiner that reaches no peer ignores SIGTERM (``stop`` kills it after its timeout)."""

    tool = GALERA

    def __init__(self, index: int, ports: list[int], home: Path, peers: str, user: str | None) -> None:
        super().__init__(f"node{index}", ports[0], home, user, label=f"node {index}")
        self.index = index
        self.gcomm_port, self.ist_port, self.sst_port = ports[1:]
        self.cnf = home / f"node{index}.cnf"
        self.peers = peers

    @property
    def ports(self) -> tuple[int, int, int, int]:
        return self.port, self.gcomm_port, self.ist_port, self.sst_port

    def options(self) -> str:
        """The text of its option file."""
        return OPTIONS.format(
            user=f"user={self.user}\n" if self.user else "", datadir=self.datadir, home=self.home,
            i=self.index, log=self.log, port=self.port, provider=PROVIDER, peers=self.peers,
            gcomm=self.gcomm_port, ist=self.ist_port, sst=self.sst_port,
        )  # fmt: skip

    def lay_out(self) -> None:
        self.cnf.write_text(self.options())
        super().lay_out()

    def install_options(self) -> list[str]:
        return [f"--defaults-file={self.cnf}"]

    async def recovered_position(self) -> str | None:
        """``uuid:seqno`` where a node killed mid-flight stopped (``mariadbd --wsrep-recover`` reads it
        from InnoDB), or None when ``grastate.dat`` says it already (a clean stop) or it never ran."""
        state = grastate(self.datadir)
        if state.get("seqno", "-1") != "-1" or not state.get("uuid", "").strip("0-"):
            return None
        log = self.home / f"node{self.index}.recover.err"
        log.unlink(missing_ok=True)
        done = await asyncio.create_subprocess_exec(
            program("mariadbd"), f"--defaults-file={self.cnf}", "--wsrep-recover", f"--log-error={log}",
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        await finish(done)
        try:
            found = re.findall(r"Recovered position:\s*(\S+:-?\d+)", log.read_text(errors="replace"))
        except OSError:
            return None
        return found[-1] if found and not found[-1].endswith(":-1") else None

    async def start(self, bootstrap: bool = False) -> None:
        """Start the process — a new cluster (``--wsrep-new-cluster``) when ``bootstrap``, else joining
        the others — from the position a crash left (``recovered_position``); does not wait for Synced."""
        self._check_stopped()
        options = [f"--defaults-file={self.cnf}"]
        position = await self.recovered_position()
        if position:
            options.append(f"--wsrep-start-position={position}")
        if bootstrap:
            options.append("--wsrep-new-cluster")
            state = self.datadir / "grastate.dat"
            if state.exists():  # Galera refuses to bootstrap from a node it did not see leave last
                state.write_text(re.sub(r"safe_to_bootstrap:\s*0", "safe_to_bootstrap: 1", state.read_text()))
        self._spawn(options)

    async def status(self) -> dict[str, str]:
        """Its ``wsrep_*`` status variables, read on a new connection; {} when it does not answer in 2 s."""
        if not self.running or self.paused:
            return {}
        try:
            said = await asyncio.wait_for(fetch(self.port, "SHOW GLOBAL STATUS LIKE 'wsrep%'", timeout=2), 2)
        except (TimeoutError, OSError, aiomysql.Error):
            return {}
        return {str(k): str(v) for k, v in said}

    async def wait_synced(self, timeout: float = 60) -> None:
        """Until it says Synced in a Primary component; raises with its log's last lines on timeout, or at
        once when its process has ended."""
        status: dict[str, str] = {}

        async def ready() -> bool:
            nonlocal status
            status = await self.status()
            return synced(status)

        def late() -> str:
            state = status.get("wsrep_local_state_comment", "no answer")
            return f"{self.label} not Synced in {timeout:.0f} s ({state})"

        await self._wait(ready, late, timeout)
