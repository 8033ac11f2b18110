"""The nodes together (``launchers.cluster``): their ports, the order they start in, waiting for a cluster
of a size, a node rejoining, and stopping them all."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

from launchers import mariadbd
from launchers.cluster import Cluster, started
from launchers.galera.node import GALERA, GaleraError, GaleraNode, GaleraSetupError, grastate, synced
from launchers.mariadbd import pick_ports, together


def ports_from(base: int, nodes: int) -> list[int]:
    """The flat port list (SQL, gcomm, IST, SST of node 0, then of node 1, ...) with SQL ports ``base``,
    ``base + 1``, ...; gcomm from ``base + nodes``, IST from ``base + 2 * nodes``, SST after them."""
    return [base + kind * nodes + i for i in range(nodes) for kind in range(4)]


class GaleraCluster(Cluster[GaleraNode]):
    """``nodes`` Galera nodes under ``base_dir`` — or, when the nodes' user may not enter it, under a
    temp dir of their own (``home`` says which; the package's docstring why); ``ports`` flat, four a node
    (SQL, gcomm, IST, SST), else picked free."""

    tool = GALERA
    stopped = "a stopped cluster"

    def __init__(self, base_dir: Path, nodes: int = 3, ports: list[int] | None = None) -> None:
        ports = pick_ports(4 * nodes) if ports is None else ports
        if nodes < 1 or len(ports) != 4 * nodes:
            raise GaleraSetupError(f"{nodes} node(s) need {4 * nodes} ports (4 each), not {len(ports)}")
        super().__init__(base_dir)
        groups = [ports[4 * i : 4 * i + 4] for i in range(nodes)]
        peers = ",".join(f"127.0.0.1:{g[1]}" for g in groups)
        self.nodes = [GaleraNode(i, g, self.home, peers, self.run_as) for i, g in enumerate(groups)]

    def url(self, database: str) -> str:
        """``mysql://root@127.0.0.1:P1,127.0.0.1:P2,.../database``: every node, for a client to fail over."""
        return f"mysql://root@{','.join(n.address for n in self.nodes)}/{database}"

    async def _first(self) -> int:
        """Which node bootstraps: node 0 of a new cluster; else the one Galera saw leave last (safe to
        bootstrap); else — every node was killed — the most advanced."""
        states = [grastate(n.datadir) for n in self.nodes]
        if not any(states):
            return 0
        for node, state in zip(self.nodes, states, strict=True):
            if state.get("safe_to_bootstrap") == "1":
                return node.index
        recovered = await asyncio.gather(*(n.recovered_position() for n in self.nodes))
        seqnos = [
            int((r or f":{s.get('seqno', '-1')}").rsplit(":", 1)[1])
            for r, s in zip(recovered, states, strict=True)
        ]
        return max(range(len(seqnos)), key=seqnos.__getitem__)

    async def _start(self) -> None:
        """Install the data directories that are empty, bootstrap one node, then start each next once the
        one before is Synced; returns when every node sees all of them."""
        await together(*(n.install() for n in self.nodes))
        first = await self._first()
        for i in [first, *(i for i in range(len(self.nodes)) if i != first)]:
            await self.nodes[i].start(bootstrap=i == first)
            await self.nodes[i].wait_synced(timeout=120)
        await self.wait_size(len(self.nodes))

    async def wait_size(self, n: int, timeout: float = 60) -> None:
        """Until every running, un-paused node says Synced, Primary, and a cluster of ``n``."""
        deadline = time.monotonic() + timeout
        while True:
            live = [node for node in self.nodes if node.running and not node.paused]
            statuses = await asyncio.gather(*(node.status() for node in live))
            if all(synced(s) and s.get("wsrep_cluster_size") == str(n) for s in statuses):
                return
            if time.monotonic() > deadline:
                said = "; ".join(
                    f"node {node.index}: size {s.get('wsrep_cluster_size', '?')}"
                    f" {s.get('wsrep_local_state_comment', 'no answer')}"
                    for node, s in zip(live, statuses, strict=True)
                )
                raise GaleraError(f"no cluster of {n} in {timeout:.0f} s ({said})")
            await asyncio.sleep(0.1)

    async def rejoin(self, node: GaleraNode, timeout: float = 120) -> None:
        """Start a killed or stopped node again and wait until it is Synced: IST from a donor's cache when
        its position is known (always, after ``recovered_position``), else a full copy (SST)."""
        await node.start()
        await node.wait_synced(timeout)

    async def create_database(self, name: str, *, replace: bool = True) -> None:
        """Database ``name`` (utf8mb4), made on node 0; an existing one is dropped first unless not
        ``replace``."""
        await mariadbd.create_database(self.nodes[0].port, name, replace=replace)

    async def _stop_all(self) -> None:
        # One at a time, node 0 last: the last to leave is marked safe to bootstrap, so the next start
        # needs no recovery (stopped together, every node said safe_to_bootstrap: 0).
        for node in reversed(self.nodes):
            await node.stop()


def galera_cluster(
    base_dir: Path, nodes: int = 3, ports: list[int] | None = None
) -> contextlib.AbstractAsyncContextManager[GaleraCluster]:
    """A started cluster of ``nodes`` (every one Synced, each seeing all), closed on the way out."""
    return started(lambda: GaleraCluster(base_dir, nodes, ports))
