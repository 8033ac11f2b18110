"""One Galera node: its option file, its ``mariadbd`` process (started, paused, killed, stopped) and
what it says about itself (``wsrep_*`` status)."""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import subprocess
import time
from pathlib import Path

import aiomysql

from launchers.mariadbd import finish, log_tail, port_free, which

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


def program(name: str) -> str:
    """The path of ``mariadbd``, ``mariadb-install-db`` or ``rsync`` (sbin is not on every PATH)."""
    found = which(name)
    if found is None:
        raise GaleraSetupError(f"{name} is not installed (apt-get install mariadb-server galera-4 rsync)")
    return found


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


class GaleraNode:
    """One ``mariadbd`` of the cluster: ``port`` is its SQL port; ``pid`` is None unless it runs."""

    def __init__(self, index: int, ports: list[int], home: Path, peers: str, user: str | None) -> None:
        self.index = index
        self.port, self.gcomm_port, self.ist_port, self.sst_port = ports
        self.home = home
        self.datadir = home / f"node{index}"
        self.cnf = home / f"node{index}.cnf"
        self.log = home / f"node{index}.err"
        # Its own temp dir: nodes sharing /tmp clashed on temporary table names (mariadb-install-db run
        # side by side failed one time in three: "Unknown table 'mysql.tmp_user_sys'").
        self.tmpdir = home / f"node{index}.tmp"
        self.peers = peers
        self.user = user
        self.paused = False
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def ports(self) -> tuple[int, int, int, int]:
        return self.port, self.gcomm_port, self.ist_port, self.sst_port

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    @property
    def running(self) -> bool:
        return self.pid is not None

    def options(self) -> str:
        """The text of its option file."""
        return OPTIONS.format(
            user=f"user={self.user}\n" if self.user else "", datadir=self.datadir, home=self.home,
            i=self.index, log=self.log, port=self.port, provider=PROVIDER, peers=self.peers,
            gcomm=self.gcomm_port, ist=self.ist_port, sst=self.sst_port,
        )  # fmt: skip

    def log_tail(self, lines: int = 8) -> str:
        return log_tail(self.log, lines)

    async def install(self) -> None:
        """``mariadb-install-db`` into an empty data directory (nothing when it holds a database)."""
        if (self.datadir / "mysql").is_dir():
            return
        done = await asyncio.create_subprocess_exec(
            program("mariadb-install-db"), f"--defaults-file={self.cnf}", "--skip-test-db",
            "--auth-root-authentication-method=normal",  # root@127.0.0.1, no password, over TCP
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        out, _ = await finish(done)
        if done.returncode != 0:
            said = " | ".join(out.decode(errors="replace").strip().splitlines()[-5:])
            raise GaleraError(f"node {self.index}: mariadb-install-db failed: {said}")

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
        if self.running:
            raise GaleraError(f"node {self.index} runs already (pid {self.pid})")
        for port in self.ports:
            if not port_free(port):
                raise GaleraSetupError(f"port {port} (node {self.index}) is in use: choose other ports")
        args = [program("mariadbd"), f"--defaults-file={self.cnf}"]
        position = await self.recovered_position()
        if position:
            args.append(f"--wsrep-start-position={position}")
        if bootstrap:
            args.append("--wsrep-new-cluster")
            state = self.datadir / "grastate.dat"
            if state.exists():  # Galera refuses to bootstrap from a node it did not see leave last
                state.write_text(re.sub(r"safe_to_bootstrap:\s*0", "safe_to_bootstrap: 1", state.read_text()))
        self.paused = False
        self._proc = self._spawn(args)

    def _spawn(self, args: list[str]) -> subprocess.Popen[bytes]:
        # A session of its own: a terminal's Ctrl-C reaches the launcher alone, which stops the nodes.
        return subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )

    def _signal(self, sig: signal.Signals) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL, as a crash (``grastate.dat`` keeps seqno -1); returns once the process is reaped."""
        if self._proc is not None:
            self._signal(signal.SIGKILL)
            self._proc.wait()
        self.paused = False

    def pause(self) -> None:
        """SIGSTOP: the process stays but answers nobody (a hung machine); the others drop it ~3 s on."""
        self._signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        """SIGCONT after ``pause``."""
        self._signal(signal.SIGCONT)
        self.paused = False

    async def stop(self, timeout: float = 30) -> None:
        """SIGTERM (a clean shutdown: ``grastate.dat`` keeps the position) and wait; SIGKILL after
        ``timeout`` (a joiner that reaches no peer ignores SIGTERM). Cancelled, the process runs on:
        ``kill`` it."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        self._signal(signal.SIGCONT)
        self._signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            await asyncio.to_thread(proc.wait, timeout)
        self.kill()

    async def status(self) -> dict[str, str]:
        """Its ``wsrep_*`` status variables, read on a new connection; {} when it does not answer in 2 s."""
        if not self.running or self.paused:
            return {}
        try:
            return await asyncio.wait_for(self._status(), 2)
        except (TimeoutError, OSError, aiomysql.Error):
            return {}

    async def _status(self) -> dict[str, str]:
        conn = await aiomysql.connect(host="127.0.0.1", port=self.port, user="root", connect_timeout=2)
        try:
            async with conn.cursor() as cur:
                await cur.execute("SHOW GLOBAL STATUS LIKE 'wsrep%'")
                return {str(k): str(v) for k, v in await cur.fetchall()}
        finally:
            conn.close()

    async def wait_synced(self, timeout: float = 60) -> None:
        """Until it says Synced in a Primary component; raises with its log's last lines on timeout, or at
        once when its process has ended."""
        deadline = time.monotonic() + timeout
        while not synced(status := await self.status()):
            if not self.running:
                raise GaleraError(f"node {self.index} (port {self.port}) exited: {self.log_tail()}")
            if time.monotonic() > deadline:
                state = status.get("wsrep_local_state_comment", "no answer")
                raise GaleraError(
                    f"node {self.index} not Synced in {timeout:.0f} s ({state}): {self.log_tail()}"
                )
            await asyncio.sleep(0.1)
