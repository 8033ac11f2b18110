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

    def __init__(
        self,
        db: Database,
        counts: MemberCounts,
        spawn: Callable[[Awaitable[Any]], None],
    ) -> None:
        self.db = db
        self.counts = counts
        self.spawn = spawn
        self.asked = 0  # users' groups asked for, and reads made for them (coalescing is the difference)
        self.reads = 0
        self.flying = 0  # reads on their way
        self._waiting: Waiting = {}
        self._soon = False

    async def of(self, user_id: UserId) -> list[UserGroup]:
        """The user's groups, as ``groups.groups_of`` reads them."""
        future: asyncio.Future[list[UserGroup]] = asyncio.get_running_loop().create_future()
        self.asked += 1
        self._waiting.setdefault(user_id, []).append(future)
        if not self._soon and self.flying < AT_ONCE:
            self._soon = True
            asyncio.get_running_loop().call_soon(self._flush)
        return await future

    def _flush(self) -> None:
        self._soon = False
        while self._waiting and self.flying < AT_ONCE:
            users = list(itertools.islice(self._waiting, MOST))
            batch = {u: self._waiting.pop(u) for u in users}
            self.flying += 1
            self.reads += 1
            self.spawn(self._read(batch))

    async def _read(self, batch: Waiting) -> None:
        try:
            found = await groups.groups_of_many(self.db, list(batch), self.counts)
        except BaseException as e:
            for futures in batch.values():
                for f in futures:
                    if not f.done():
                        f.set_exception(e) if isinstance(e, Exception) else f.cancel()
            if not isinstance(e, Exception):
                raise  # (the hub stopping: its waiters are cancelled with it)
        else:
            for user, futures in batch.items():
                for f in futures:
                    if not f.done():
                        f.set_result(found[user])
        finally:
            self.flying -= 1
            self._flush()  # those who came while this read was on its way
