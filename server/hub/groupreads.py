"""The welcomes' reads of their users' groups, coalesced: while a read is on its way to the database, the
sockets that open meanwhile wait for the next one, which reads the groups of all of them at once
(``groups.groups_of_many``, at most ``MOST`` users). A lone socket is read at once, as before; a
reconnect storm of 10,000 sockets makes a few hundred reads instead of 10,000.

Each socket's wait is its own: the welcome's bound (``handshake_seconds``) cancels only its own wait, and
the read goes on for the others. A read is bounded as every statement is (``db_statement_timeout_ms``):
one that fails or runs out fails every socket waiting for it with its error (``database_unavailable``:
answered 1013 by the welcome), and the sockets that came meanwhile get a read of their own."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from typing import Any

from server import errors
from server.errors import Unavailable
from server.ids import UserId
from server.money import groups
from server.money.groups import MemberCounts, UserGroup
from server.store.db import Database

# Users one read asks for (the statement's IN list), and reads on their way at once.
MOST = 500
AT_ONCE = 2

Waiting = dict[UserId, list["asyncio.Future[list[UserGroup]]"]]


class GroupReads:
    """The hub's one reader of its welcomes' groups (``Hub.group_reads``)."""

    def __init__(self, db: Database, counts: MemberCounts, spawn: Callable[[Awaitable[Any]], None]) -> None:
        self.db = db
        self.counts = counts
        self.spawn = spawn
        self.asked = 0  # users' groups asked for, and reads made for them (coalescing is the difference)
        self.reads = 0
        self.flying = 0  # reads on their way
        self.closed = False
        self._waiting: Waiting = {}
        self._soon = False

    @property
    def waiting(self) -> int:
        """Users waiting for a read to start."""
        return len(self._waiting)

    async def of(self, user_id: UserId) -> list[UserGroup]:
        """The user's groups, as ``groups.groups_of`` reads them."""
        if self.closed:
            raise _stopping()
        future: asyncio.Future[list[UserGroup]] = asyncio.get_running_loop().create_future()
        self.asked += 1
        self._waiting.setdefault(user_id, []).append(future)
        if not self._soon and self.flying < AT_ONCE:
            self._soon = True
            asyncio.get_running_loop().call_soon(self._flush)
        try:
            return await future
        except asyncio.CancelledError:  # (its welcome gave up: not read for a socket that is gone)
            futures = self._waiting.get(user_id)
            if futures is not None and future in futures:
                futures.remove(future)
                if not futures:
                    del self._waiting[user_id]
            raise

    def close(self) -> None:
        """The hub stops: no read starts any more, and every socket still waiting is refused."""
        self.closed = True
        waiting, self._waiting = self._waiting, {}
        _settle(waiting, _stopping())

    def _flush(self) -> None:
        self._soon = False
        while self._waiting and self.flying < AT_ONCE and not self.closed:
            users = list(itertools.islice(self._waiting, MOST))
            batch = {u: self._waiting.pop(u) for u in users}
            self.flying += 1
            self.reads += 1
            self.spawn(self._read(batch))

    async def _read(self, batch: Waiting) -> None:
        try:
            found = await groups.groups_of_many(self.db, list(batch), self.counts)
        except Exception as e:
            _settle(batch, e)
        except BaseException:
            _settle(batch, _stopping())
            self.flying -= 1
            raise  # (the hub stopping: no read after this one)
        else:
            for user, futures in batch.items():
                for f in futures:
                    if not f.done():
                        f.set_result(found[user])
        self.flying -= 1
        self._flush()  # those who came while this read was on its way


def _settle(waiting: Waiting, error: Exception) -> None:
    for futures in waiting.values():
        for f in futures:
            if not f.done():
                f.set_exception(error)


def _stopping() -> Unavailable:
    return Unavailable(errors.DATABASE_UNAVAILABLE, "the hub is stopping")
