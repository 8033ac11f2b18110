"""Throw-away ``redis-server`` processes for a bench to measure and flush as it likes: on free local
ports, in a temporary directory, stopped (and the directory removed) on the way out.

A ``Setup`` names what the server carries besides the data: an append-only file (``appendfsync
everysec``), a replica to feed, cluster mode (one node owning every slot), or all three — one master of a
cluster as ``tests/redisproc.py`` starts it. With ``callgrind`` the master runs under valgrind's
callgrind, which counts the instructions it executes (``zero`` and ``instructions`` around what is
measured): a figure that does not move with the machine's load, at ~50 times the CPU.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import redis


class Setup(Enum):
    PLAIN = "plain"  # no persistence, no replica
    AOF = "aof"  # appendonly yes, appendfsync everysec
    REPLICA = "replica"  # and a replica, no persistence
    CLUSTER = "cluster"  # cluster mode: one node, every slot, no persistence
    CLUSTER_AOF_REPLICA = "cluster-aof-replica"  # a cluster's master as tests/redisproc.py starts one

    @property
    def aof(self) -> bool:
        return self in (Setup.AOF, Setup.CLUSTER_AOF_REPLICA)

    @property
    def replica(self) -> bool:
        return self in (Setup.REPLICA, Setup.CLUSTER_AOF_REPLICA)

    @property
    def cluster(self) -> bool:
        return self in (Setup.CLUSTER, Setup.CLUSTER_AOF_REPLICA)


class ServerProblem(RuntimeError):
    """A throw-away server did not come up, or a tool it needs is missing."""


def command(r: redis.Redis, *args: str | int | float | bytes) -> Any:
    """One command through redis-py's sync client, its reply parsed as redis-py parses it (``INFO``
    into a dict). (The sync client's typed methods say ``Awaitable | Any``: one untyped call instead.)"""
    return r.execute_command(*args)  # type: ignore[no-untyped-call]


def free_port(cluster: bool = False) -> int:
    """A port nothing listens on now; in cluster mode one whose bus port (+10000) is free and valid too."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if not cluster:
            return port
        if port + 10_000 <= 65_535:
            with socket.socket() as bus:
                try:
                    bus.bind(("127.0.0.1", port + 10_000))
                except OSError:
                    continue
            return port


@dataclass
class Server:
    """One running server: its port, its process, and (under callgrind) where its counts are dumped."""

    port: int
    proc: subprocess.Popen[bytes]
    dump: Path | None = None

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=600)

    def zero(self) -> None:
        """Start counting instructions from here (callgrind only)."""
        if self.dump is not None:
            subprocess.run(["callgrind_control", "-z", str(self.proc.pid)], check=True, capture_output=True)

    def instructions(self) -> int:
        """Instructions executed since ``zero`` (callgrind only): the counts dumped now."""
        if self.dump is None:
            raise ServerProblem("not under callgrind")
        for old in self.dump.parent.glob(self.dump.name + ".*"):
            old.unlink()
        subprocess.run(["callgrind_control", "-d", str(self.proc.pid)], check=True, capture_output=True)
        for dumped in self.dump.parent.glob(self.dump.name + ".*"):
            for line in dumped.read_text(errors="replace").splitlines():
                if line.startswith(("summary:", "totals:")):
                    return int(line.split()[1])
        raise ServerProblem(f"callgrind dumped no totals next to {self.dump}")


def _start(directory: Path, extra: list[str], callgrind: bool) -> Server:
    """Start one; a port taken between choosing it and binding it gets another (three tries)."""
    for attempt in ("1", "2"):
        with contextlib.suppress(ServerProblem):
            return _start_once(directory / attempt, extra, callgrind)
    return _start_once(directory / "3", extra, callgrind)


def _start_once(directory: Path, extra: list[str], callgrind: bool) -> Server:
    exe = shutil.which("redis-server")
    if exe is None:
        raise ServerProblem("redis-server is not on PATH")
    directory.mkdir(parents=True)
    port = free_port("--cluster-enabled" in extra)
    cmd = [exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(directory), "--save", "",
           "--logfile", str(directory / "server.log"), *extra]  # fmt: skip
    dump = None
    if callgrind:
        if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
            raise ServerProblem("counting instructions needs valgrind (apt-get install valgrind)")
        dump = directory / "callgrind.out"
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={dump}", *cmd]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = Server(port, proc, dump)
    deadline = time.monotonic() + 60
    while True:
        try:
            if command(server.client(), "PING"):
                return server
        except redis.ConnectionError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            log = directory / "server.log"
            said = log.read_text(errors="replace").splitlines()[-5:] if log.exists() else []
            raise ServerProblem(f"redis-server on port {port} did not come up: {' | '.join(said)}")
        time.sleep(0.05)


def _wait(what: str, ready: bool, deadline: float) -> bool:
    if not ready and time.monotonic() > deadline:
        raise ServerProblem(f"a throw-away server: {what} took over 60 s")
    if not ready:
        time.sleep(0.05)
    return ready


def _cluster_up(master: Server, replica: Server | None) -> None:
    """One node owns every slot; the replica (if any) follows it."""
    m = master.client()
    command(m, "CLUSTER", "ADDSLOTSRANGE", 0, 16383)
    deadline = time.monotonic() + 60
    while not _wait("cluster_state:ok", b"cluster_state:ok" in command(m, "CLUSTER", "INFO"), deadline):
        pass
    if replica is not None:
        r = replica.client()
        command(r, "CLUSTER", "MEET", "127.0.0.1", master.port)
        master_id = command(m, "CLUSTER", "MYID").decode()
        while not _wait(
            "the replica meeting its master", master_id in str(command(r, "CLUSTER", "NODES")), deadline
        ):
            pass
        command(r, "CLUSTER", "REPLICATE", master_id)


@contextlib.contextmanager
def throwaway_server(setup: Setup, callgrind: bool = False, config: Sequence[str] = ()) -> Iterator[Server]:
    """A master as ``setup`` says (under callgrind if asked), with its replica if it has one, each with
    the server options ``config`` (``["--hash-max-listpack-entries", "128"]``) too; both stopped and their
    directory removed on the way out."""
    where = Path(tempfile.mkdtemp(prefix="redpacket-throwaway-"))
    extra = ["--appendonly", "yes", "--appendfsync", "everysec"] if setup.aof else ["--appendonly", "no"]
    extra += config
    if setup.cluster:  # (the config file lands in each server's own --dir)
        extra += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
    started: list[Server] = []
    try:
        started.append(_start(where / "master", extra, callgrind))
        master, replica = started[0], None
        if setup.replica:
            follow = [] if setup.cluster else ["--replicaof", "127.0.0.1", str(master.port)]
            started.append(_start(where / "replica", [*extra, *follow], callgrind=False))
            replica = started[1]
        if setup.cluster:
            _cluster_up(master, replica)
        if replica is not None:
            m, deadline = master.client(), time.monotonic() + 60
            while not _wait("the replica's sync", _replica_online(m), deadline):
                pass
        yield master
    finally:
        for s in started:
            s.proc.terminate()
        for s in started:
            try:
                s.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                s.proc.kill()
                s.proc.wait()
        shutil.rmtree(where, ignore_errors=True)


def _replica_online(master: redis.Redis) -> bool:
    info = command(master, "INFO", "replication")
    return int(info["connected_slaves"]) >= 1 and "online" in str(info.get("slave0", ""))
