"""What the local MariaDB tools (``galera/``, ``spider/``) share beside their servers (``node``), the servers
together (``cluster``) and their command (``cli``): which tool says what (``Tool``: its name, errors and
what it needs installed), finding MariaDB's programs, ports a server can be restarted on, the user the
servers run as and whether it may reach a directory, a helper process ended even when cancelled, steps
run side by side, and asking a server for rows, a database or a ``SELECT 1``."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import random
import re
import shutil
import socket
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiomysql

# Below the kernel's ephemeral range (32768-60999): a server restarted on its ports never finds one taken
# meanwhile by an outgoing connection's local end.
PICKED_PORTS = range(20_000, 32_768)
_picked: set[int] = set()


def which(name: str) -> str | None:
    """The path of ``mariadbd``, ``mariadb-install-db`` or ``rsync`` (sbin is not on every PATH)."""
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/local/sbin")


@dataclass(frozen=True)
class Tool:
    """One launcher of ``mariadbd`` servers (``galera``, ``spider``): its ``name`` (its command's lines start
    ``name: ``, its temp dirs ``redpacket-name-``), what it calls its servers (``members``: ``nodes``), its
    two errors (``setup_error``, a subclass of ``error``, for what the operator fixes before anything
    starts), and what its servers need installed: ``programs`` (``install`` says how) and a ``library``."""

    name: str
    members: str
    error: type[Exception]
    setup_error: type[Exception]
    programs: tuple[str, ...]
    install: str  # "apt-get install ...": every program
    library: Path
    library_name: str  # "Galera library": the messages'
    library_package: str

    def program(self, name: str) -> str:
        """The path of ``name`` (sbin is not on every PATH); a ``setup_error`` saying what to install when
        there is none."""
        found = which(name)
        if found is None:
            raise self.setup_error(f"{name} is not installed ({self.install})")
        return found

    def check_installed(self) -> None:
        """Every one of ``programs``, and the library; a ``setup_error`` saying what to install when one is
        missing."""
        for name in self.programs:
            self.program(name)
        if not self.library.exists():
            raise self.setup_error(
                f"no {self.library_name} at {self.library} (apt-get install {self.library_package})"
            )


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as mariadbd and Galera bind theirs
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def pick_ports(count: int) -> list[int]:
    """``count`` ports free now, below the ephemeral range, never picked before by this process."""
    ports: list[int] = []
    while len(ports) < count:
        port = random.choice(PICKED_PORTS)
        if port not in _picked and port_free(port):
            _picked.add(port)
            ports.append(port)
    return ports


def node_user() -> pwd.struct_passwd | None:
    """Who the servers run as: ``mysql`` when we are root (None when there is no such user), else us."""
    try:
        return pwd.getpwnam("mysql") if os.geteuid() == 0 else pwd.getpwuid(os.geteuid())
    except KeyError:
        return None


def blocked_for(user: pwd.struct_passwd, directory: Path) -> Path | None:
    """The first directory above ``directory`` that ``user`` may not enter, or None."""
    for parent in reversed(directory.resolve().parents):
        st = parent.stat()
        if not (
            st.st_mode & 0o001
            or (st.st_uid == user.pw_uid and st.st_mode & 0o100)
            or (st.st_gid == user.pw_gid and st.st_mode & 0o010)
        ):
            return parent
    return None


def unenterable(directory: Path, servers: str, example: str) -> str:
    """Why the servers (run as ``node_user``) could not live in ``directory``, in one line, or "" when
    they can: a directory above it their user may not enter."""
    user = node_user()
    blocked = blocked_for(user, directory) if user is not None else None
    if blocked is None or user is None:
        return ""
    return (
        f"the {servers} run as {user.pw_name}, who may not enter {blocked}: choose a DIR every directory"
        f" above which others may enter (e.g. {example})"
    )


def hand_over(home: Path, user: pwd.struct_passwd | None) -> None:
    """Give ``home`` and all in it to ``user`` when we are root (mariadbd, run as ``mysql``, must own its
    data directory and the directory of its socket); otherwise check that we may write it. Raises
    OSError."""
    if os.geteuid() == 0 and user is not None:
        home.chmod(0o755)
        for path in [home, *home.rglob("*")]:
            os.chown(path, user.pw_uid, user.pw_gid, follow_symlinks=False)
    elif not os.access(home, os.W_OK | os.X_OK):
        raise PermissionError(f"{home} is not writable")


def log_tail(log: Path, lines: int = 8) -> str:
    """The last ``lines`` of a server's error log, on one line."""
    try:
        said = log.read_text(errors="replace").splitlines()[-lines:]
    except OSError as e:
        return f"(no log: {e})"
    return " | ".join(line.strip() for line in said)


async def finish(proc: asyncio.subprocess.Process) -> tuple[bytes, bytes]:
    """Its output once it ends; cancelled, it is killed first (never left running)."""
    try:
        return await proc.communicate()
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await asyncio.shield(proc.wait())
        raise


async def together(*steps: Awaitable[None]) -> None:
    """Every step side by side, each to its end (none left running); then the first failure raised."""
    for failed in await asyncio.gather(*steps, return_exceptions=True):
        if failed is not None:
            raise failed


async def answers(port: int, timeout: float = 2) -> bool:
    """Whether the server on ``port`` answers ``SELECT 1`` as root over TCP within ``timeout``."""
    try:
        return await asyncio.wait_for(fetch(port, "SELECT 1", timeout=timeout), timeout) == ((1,),)
    except (TimeoutError, OSError, aiomysql.Error):
        return False


async def fetch(port: int, statement: str, *, timeout: float = 5) -> tuple[tuple[Any, ...], ...]:
    """The rows of ``statement`` run as root on the server at ``port``, on a connection of its own (made
    within ``timeout``). Raises OSError or aiomysql.Error."""
    conn = await aiomysql.connect(host="127.0.0.1", port=port, user="root", connect_timeout=timeout)
    try:
        async with conn.cursor() as cur:
            await cur.execute(statement)
            return tuple(await cur.fetchall())
    finally:
        await _close(conn)


async def _close(conn: aiomysql.Connection) -> None:
    # Said goodbye (COM_QUIT), so the server logs no "Aborted connection" for each poll.
    try:
        await conn.ensure_closed()
    except (OSError, aiomysql.Error):
        conn.close()


async def create_database(port: int, name: str, *, replace: bool = True) -> None:
    """Database ``name`` (utf8mb4) on the server at ``port``; an existing one is dropped first unless not
    ``replace``."""
    if not re.fullmatch(r"\w+", name):
        raise ValueError(f"a database name is letters, digits and _: {name!r}")
    conn = await aiomysql.connect(host="127.0.0.1", port=port, user="root", connect_timeout=5)
    try:
        async with conn.cursor() as cur:
            # Asked first: DROP ... IF EXISTS of a missing one answers with a warning, and aiomysql
            # turns a warning into a Python warning (an error under pytest's filterwarnings).
            await cur.execute("SELECT 1 FROM information_schema.SCHEMATA WHERE SCHEMA_NAME = %s", (name,))
            exists = bool(await cur.fetchall())
            if exists and replace:
                await cur.execute(f"DROP DATABASE `{name}`")
            if replace or not exists:
                await cur.execute(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4")
    finally:
        await _close(conn)
