"""A TCP proxy in front of MariaDB that can lose the answer to a COMMIT: the server commits, the client
sees its connection die (``2013 Lost connection``) and cannot know whether it did. What an unreliable
network or a database failover does to a transaction at its worst moment, made to happen on purpose.

The proxy reads the client's MySQL packets (3-byte length, sequence id, payload); a ``COM_QUERY`` of
``COMMIT`` while armed is passed to the server, the server's answer is read, and then both sides are
closed without passing it on.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import urlparse, urlunparse

from server.core import Core, open_core

COM_QUERY = 0x03


class MySQLProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self.armed = 0  # COMMIT answers still to lose
        self.after: bytes | None = None  # only of a transaction that sent a statement holding this
        self.lost = 0  # COMMIT answers lost so far
        self.down_after_loss = False
        self.holding = False
        self.cut_on: bytes | None = None  # a statement holding this closes its connection, and the proxy
        self.refusing = False  # ...then refuses every connection until ``restore()``
        self.slowing: tuple[bytes, bytes] | None = None  # (after, until): ``slow_commit``
        self._kept: list[tuple[bytes, bytes, asyncio.StreamReader, asyncio.StreamWriter]] = []
        self.released = 0  # slow COMMITs passed on after the statement they waited for
        self._flowing = asyncio.Event()  # cleared: answers nothing (connections accepted, statements kept)
        self._flowing.set()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def lose_commit_answers(self, n: int = 1, after: bytes | None = None, then_down: bool = False) -> None:
        """Lose the answers of the next ``n`` COMMITs (with ``after``: of transactions that sent a
        statement holding those bytes); ``then_down``: and the server goes away with the first
        (``go_down``), as when a node dies between committing and answering."""
        self.armed += n
        self.after = after
        self.down_after_loss = then_down

    def slow_commit(self, after: bytes, until: bytes) -> None:
        """The next COMMIT of a transaction that sent a statement holding ``after`` is kept from the server
        (its transaction stays open, its locks held) and its client's connection is closed, as when the
        answer of a slow COMMIT is given up on; it reaches the server, and commits, just after a statement
        holding ``until`` does on another connection (``released`` counts those)."""
        self.slowing = (after, until)

    def hold_commit_answer(self) -> None:
        """The next COMMIT reaches the server, which commits; its answer, and everything after it, is
        held (``hang``) until ``restore()``: a node that stops answering right after committing."""
        self.holding = True

    def cut_at(self, marker: bytes) -> None:
        """The database goes away when a statement holding ``marker`` arrives: that connection is closed
        (the statement not passed on) and new ones are refused, until ``restore()``."""
        self.cut_on = marker

    def restore(self) -> None:
        self.cut_on, self.refusing = None, False
        self._flowing.set()

    def go_down(self) -> None:
        """The server dies (kill -9): every connection through the proxy is closed, new ones are refused,
        until ``restore()``."""
        self.refusing = True
        for t in list(self._tasks):
            t.cancel()

    def hang(self) -> None:
        """The server stops answering (SIGSTOP, a partition): connections open, nothing passes, until
        ``restore()``."""
        self._flowing.clear()

    def url(self, database_url: str) -> str:
        """``database_url`` pointed at this proxy."""
        u = urlparse(database_url)
        user, _, _ = u.netloc.rpartition("@")
        host = f"127.0.0.1:{self.port}"
        return urlunparse(u._replace(netloc=f"{user}@{host}" if user else host))

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        if self.refusing:
            client_w.close()
            return
        await self._flowing.wait()  # hung: the handshake never comes (bounded by the client's timeouts)
        try:
            server_r, server_w = await asyncio.open_connection(*self.target)
        except OSError:
            client_w.close()
            return
        losing = asyncio.Event()  # the next answer of the server is to be lost
        up = asyncio.create_task(self._upstream(client_r, server_w, losing, server_r))
        down = asyncio.create_task(self._downstream(server_r, client_w, losing))
        for t in (up, down):
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)
        try:
            await asyncio.wait([up, down], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (up, down):
                t.cancel()
            client_w.close()
            if not any(kept[3] is server_w for kept in self._kept):  # (a slow COMMIT's: kept open)
                server_w.close()

    async def _upstream(
        self,
        client_r: asyncio.StreamReader,
        server_w: asyncio.StreamWriter,
        losing: asyncio.Event,
        server_r: asyncio.StreamReader,
    ) -> None:
        marked = False  # this connection's transaction sent the statement ``after`` names
        slow_marked = False  # ... the statement ``slow_commit``'s ``after`` names
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                header = await client_r.readexactly(4)
                payload = await client_r.readexactly(int.from_bytes(header[:3], "little"))
                query = payload[1:] if payload[:1] == bytes([COM_QUERY]) else b""
                if self.cut_on is not None and self.cut_on in query:
                    self.refusing = True
                    return
                await self._flowing.wait()  # hung: the statement never reaches the server
                marked = marked or (self.after is not None and self.after in query)
                slow_marked = slow_marked or (self.slowing is not None and self.slowing[0] in query)
                commit = query.strip().upper() == b"COMMIT"
                if commit and slow_marked and self.slowing is not None:
                    self._kept.append((self.slowing[1], header + payload, server_r, server_w))
                    self.slowing = None
                    self.lost += 1  # its client gives up on it now; it commits later
                    return  # (the client's connection closes; the server's stays open, the COMMIT kept)
                for kept in [k for k in self._kept if k[0] in query]:
                    self._kept.remove(kept)
                    server_w.write(header + payload)  # this statement first (it waits on the kept locks)
                    await server_w.drain()
                    header = payload = b""
                    release = asyncio.get_running_loop().create_task(self._release(*kept[1:]))
                    self._tasks.add(release)
                    release.add_done_callback(self._tasks.discard)
                if commit and self.armed and (self.after is None or marked):
                    self.armed -= 1
                    losing.set()  # before the COMMIT goes: its answer is the next thing the server sends
                if commit or query.strip().upper() == b"ROLLBACK":
                    marked = False
                if commit and self.holding:
                    self.holding = False
                    self.hang()  # the COMMIT goes on; its answer waits at the downstream copy
                if header:
                    server_w.write(header + payload)
                    await server_w.drain()
                if losing.is_set():
                    await asyncio.Future()  # the downstream copy ends the connection

    async def _release(
        self, commit: bytes, server_r: asyncio.StreamReader, server_w: asyncio.StreamWriter
    ) -> None:
        """A kept slow COMMIT goes to the server (counted as it is written: the statement waiting on its
        locks cannot end before, so a test that saw that statement end sees the count); its answer is read
        and its connection closed."""
        with contextlib.suppress(ConnectionError):
            server_w.write(commit)
            self.released += 1
            await server_w.drain()
            await server_r.read(65536)
        server_w.close()

    async def _downstream(
        self, server_r: asyncio.StreamReader, client_w: asyncio.StreamWriter, losing: asyncio.Event
    ) -> None:
        with contextlib.suppress(ConnectionError):
            while True:
                data = await server_r.read(65536)
                if not data:
                    return
                if losing.is_set():
                    self.lost += 1  # the server answered the COMMIT: it committed; the client never hears
                    if self.down_after_loss:
                        self.down_after_loss = False
                        self.go_down()
                    return
                await self._flowing.wait()  # hung: no answer reaches the client
                client_w.write(data)
                await client_w.drain()


@asynccontextmanager
async def mysql_proxy(database_url: str) -> AsyncIterator[MySQLProxy]:
    u = urlparse(database_url)
    proxy = MySQLProxy(u.hostname or "127.0.0.1", u.port or 3306)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.close()


@asynccontextmanager
async def core_behind_proxy(core: Core) -> AsyncIterator[tuple[Core, MySQLProxy]]:
    """A Core like ``core`` whose database connections go through a ``MySQLProxy``."""
    async with mysql_proxy(core.settings.database_url) as proxy:
        async with open_core(core.settings.replace(database_url=proxy.url(core.settings.database_url))) as c:
            yield c, proxy
