"""What the tests of the local MariaDB tools (``launchers.galera``, ``launchers.spider``) and of what runs on
them share: whether Galera is installed, ports, a statement on a server, the ``up`` command run as an
operator runs it (and every ``mariadbd`` it started found), and a ``redpacket bench`` run beside them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import aiomysql
import pytest

from launchers.galera.node import GALERA, GaleraSetupError
from server.settings import child_env
from tests.hubtools import server_port

ROOT = Path(__file__).resolve().parent.parent


def need_galera() -> None:
    """Skip (or, with REDPACKET_TEST_REQUIRE_GALERA=1, fail) without mariadbd, rsync or the Galera library."""
    try:
        GALERA.check_installed()
    except GaleraSetupError as e:
        if os.environ.get("REDPACKET_TEST_REQUIRE_GALERA") == "1":
            pytest.fail(f"Galera is required (REDPACKET_TEST_REQUIRE_GALERA=1): {e}")
        pytest.skip(str(e))


def galera_ports(nodes: int) -> list[int]:
    """Four ports a node (SQL, gcomm, IST, SST), never given twice in this run and below the ephemeral
    range: a node restarted on its own ports finds them free."""
    return [server_port() for _ in range(4 * nodes)]


def free_block(count: int) -> int:
    """A first port whose ``count`` ports up from it are free (``--port`` takes a block)."""
    while True:
        base = server_port()
        ports = range(base, base + count)
        if ports[-1] < 32_768 and all(_bindable(p) for p in ports):
            return base


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


async def sql(
    port: int, database: str, statement: str, *args: Any, before: Sequence[str] = ()
) -> list[tuple[Any, ...]]:
    """One statement on the server at ``port`` as root (autocommit), on a new connection, after the
    statements ``before``."""
    conn = await aiomysql.connect(
        host="127.0.0.1", port=port, user="root", db=database, autocommit=True, connect_timeout=5
    )
    try:
        async with conn.cursor() as cur:
            for first in before:
                await cur.execute(first)
            await cur.execute(statement, args or None)
            return list(await cur.fetchall())
    finally:
        conn.close()


async def add_a_run(port: int, first: bool) -> int:
    """A row added to table ``runs`` of database ``cli`` on the server at ``port`` (the table made by the
    ``first`` run): the rows there are then."""
    made = ["CREATE TABLE runs (id INT AUTO_INCREMENT PRIMARY KEY)"] if first else []
    await sql(port, "cli", "INSERT INTO runs () VALUES ()", before=made)
    ((rows,),) = await sql(port, "cli", "SELECT COUNT(*) FROM runs")
    return int(rows)


def mariadbd_under(directory: Path) -> list[int]:
    """Every mariadbd process whose arguments (its option file's path, or its data directory) name
    ``directory``."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if proc.name.isdigit() and cmdline[0].endswith(b"mariadbd"):
            if any(str(directory).encode() in part for part in cmdline[1:]):
                found.append(int(proc.name))
    return found


@contextlib.contextmanager
def reachable_dir() -> Iterator[Path]:
    """A directory the servers' user may enter (pytest's tmp_path is under a mode-700 directory), removed
    on the way out."""
    directory = Path(tempfile.mkdtemp(prefix="redpacket-cli-"))
    directory.chmod(0o755)
    try:
        yield directory / "data"
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _command(tool: str, *args: str) -> list[str]:
    return [sys.executable, "-m", f"launchers.{tool}", *args]


@contextlib.asynccontextmanager
async def up(
    tool: str, directory: Path, *options: str, stop_within: float
) -> AsyncIterator[asyncio.subprocess.Process]:
    """``python -m launchers.<tool> up DIR *options`` running (its stdout and stderr piped). After the
    body, SIGTERM ends it within ``stop_within`` seconds with exit code 0, no traceback and no server
    left running; a failed body still stops what it started."""
    proc = await asyncio.create_subprocess_exec(
        *_command(tool, "up", str(directory), *options),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=ROOT,
    )  # fmt: skip
    try:
        yield proc
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), stop_within)
        assert proc.returncode == 0 and "Traceback" not in err.decode(), err.decode()
    finally:
        if proc.returncode is None:  # a failed test still stops what it started
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 60)
            finally:
                for pid in [proc.pid, *mariadbd_under(directory)]:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
    assert mariadbd_under(directory) == []


async def refused(
    tool: str, cases: dict[str, tuple[str, ...]], *, taken: int, reachable: Path, tmp_path: Path, ports: int
) -> None:
    """With port ``taken`` busy, each of ``cases`` (what stderr says: the command's arguments) — and, as
    root, ``up`` on a DIR under ``tmp_path`` (the servers run as mysql, who may not enter pytest's
    mode-700 directory) with ``ports`` free from its ``--port`` — ends the command with exit code 2,
    nothing on stdout and that one line on stderr, no server started under ``reachable``."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", taken))
        busy.listen()
        if os.geteuid() == 0:
            cases = {
                **cases,
                "who may not enter": ("up", str(tmp_path / "d"), "--port", str(free_block(ports))),
            }
        for said, case in cases.items():
            proc = await asyncio.create_subprocess_exec(
                *_command(tool, *case),
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                cwd=ROOT,
            )
            out, err = await asyncio.wait_for(proc.communicate(), 60)
            lines = err.decode().strip().splitlines()
            assert proc.returncode == 2 and out == b"" and len(lines) == 1, (case, lines)
            assert lines[0].startswith(f"{tool}: ") and said in lines[0], lines
            assert mariadbd_under(reachable) == []


Printed = Callable[[asyncio.StreamReader, int], Awaitable[int]]


async def up_twice(
    tool: str, directory: Path, count: str, *, ports: int, printed: Printed, stop_within: float
) -> None:
    """``python -m launchers.<tool> up DIR --<count> 2`` twice on ``directory`` (its ``--port`` with
    ``ports`` free from it): each time ``printed(stdout, port)`` checks what it printed and names the port
    of the server to add a row on (``add_a_run``), then SIGTERM ends it (``up``). The second run starts
    the same servers on the data the first left: it finds two rows."""
    port = free_block(ports)
    for run in (1, 2):
        options = (f"--{count}", "2", "--port", str(port), "--database", "cli")
        async with up(tool, directory, *options, stop_within=stop_within) as proc:
            assert proc.stdout is not None
            rows = await add_a_run(await printed(proc.stdout, port), first=run == 1)
        assert rows == run


def bench(redis_url: str, database_url: str, *args: str) -> tuple[dict[str, Any], str]:
    """``redpacket bench *args`` as an operator runs it, beside the MariaDB at ``database_url``: the figures
    of its JSON line, and its stderr (what it and its workers said, to tell why a figure is off)."""
    run = subprocess.run(
        [sys.executable, "-m", "server", "bench", *args],
        env=child_env(REDPACKET_REDIS_URL=redis_url, REDPACKET_DATABASE_URL=database_url),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-5000:]
    return json.loads(run.stdout.strip().splitlines()[-1]), run.stderr
