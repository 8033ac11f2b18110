"""Packets checked against the database before they are grabbed again after Redis may have lost writes.

Redis can come back with less than it answered: a restart from an append-only file cut short by an OS
crash, a failover to a replica that had not yet received the last writes. Its packets may then have shares
back in their lists that the database already holds as granted, and may lack grabs it had recorded.

This process notices every such event the moment it connects to the server again: each new connection
reads the server's run id before it is used (``server.store.redisnodes``), and a run id not seen before at
that address raises the *generation*. A packet is grabbed only once it was checked (``recover_packet``: the
database's grabs put back, its shares taken out of the list) in the current generation; a grab that was
in flight while the generation moved is checked and made again before it is answered
(``grabs.grab``). So no share the database holds is handed out twice, whichever process grabs.

Checks are per packet and lazy: the first grab of a packet after a restart pays one database read, and
concurrent grabs of it share that one check.

A process that meets a packet for the first time — a hub started after the packet was put up, or any
hub but the sender's — cannot tell from its own memory whether Redis lost writes before it came. So on
one server (not a cluster) a packet's state carries a *stamp* (``keys.PACKET_STAMP`` in its meta hash):
the run id and data id of the server it was loaded or checked on, as the loading process saw them
(``Repairs.stamp``). While the server still answers with that identity it has not restarted, failed
over or been demoted and promoted since, and the packet is trusted with one Redis read instead of the
database's check; any of those changes the identity, and the stamp no longer matches. The comparison
uses this process's last view of the server; the grab that follows is sent only after a look at the
server (``server.store.batch``), which fails it unsent if the view was stale. A stamp written by a
process whose view was already stale names the old server: it only costs a check more. On a cluster
there is no stamp (a slot moved away and back brings its stamp back to a server it names again):
every process checks each packet once, as before. Data replaced by hand without a restart (a
``FLUSHALL`` and a restore) is not seen by any of this: restart the server after such a restore.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from server.ids import PacketId
from server.store.redisnodes import RedisNodes

Repair = Callable[[], Awaitable[object]]
# Reads the packet's stamp from the server that holds it (None: no stamp there).
ReadStamp = Callable[[], Awaitable[str | None]]
# A key of the packet (which server it is on) and how to read its stamp there.
Stamped = tuple[str, ReadStamp]


class Repairs:
    def __init__(self, nodes: RedisNodes, remember: int = 100_000) -> None:
        self._nodes = nodes
        self._remember = remember
        self._checked: OrderedDict[PacketId, int] = OrderedDict()
        self._running: dict[tuple[PacketId, int], asyncio.Task[None]] = {}
        self.checks = 0
        self.trusted = 0  # packets met here whose stamp named the server they are on: not checked

    @property
    def generation(self) -> int:
        return self._nodes.generation

    def mark(self, packet_id: PacketId, generation: int) -> None:
        """The packet's Redis state is known good as of ``generation`` (it was just loaded or checked)."""
        self._checked[packet_id] = generation
        self._checked.move_to_end(packet_id)
        while len(self._checked) > self._remember:
            self._checked.popitem(last=False)

    def stamp(self, key: str) -> str:
        """The stamp for a packet whose keys include ``key``, loaded or checked now ("": the server is
        not known yet, so no stamp)."""
        return self._nodes.data_stamp(key)

    async def ensure(self, packet_id: PacketId, repair: Repair, stamped: Stamped | None = None) -> None:
        """Run ``repair`` for this packet unless it ran in the current generation, or its stamp
        (``stamped``: read from the server that owns that key) names that server as this process sees
        it now; concurrent callers share one run. If it fails (Redis or the database down) the caller
        gets its error and the packet is checked again next time."""
        generation = self._nodes.generation
        if self._checked.get(packet_id) == generation:
            return
        task = self._running.get((packet_id, generation))
        if task is None:
            task = asyncio.create_task(self._run(packet_id, generation, repair, stamped))
            self._running[(packet_id, generation)] = task
            task.add_done_callback(lambda _: self._running.pop((packet_id, generation), None))
        await asyncio.shield(task)

    async def _run(
        self, packet_id: PacketId, generation: int, repair: Repair, stamped: Stamped | None
    ) -> None:
        if stamped is not None:
            key, read_stamp = stamped
            found = await read_stamp()
            # Compared with what this process sees after the read; a generation moved meanwhile trusts
            # nothing.
            if found and found == self.stamp(key) and self._nodes.generation == generation:
                self.trusted += 1
                self.mark(packet_id, generation)
                return
        self.checks += 1
        await repair()
        self.mark(packet_id, generation)
