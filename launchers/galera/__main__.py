"""``python -m launchers.galera up DIR``: a Galera cluster on this machine until Ctrl-C or SIGTERM.

It prints the cluster's URL (every node: ``mysql://root@127.0.0.1:P1,.../redpacket``) on one line of
stdout once every node is Synced, then stops every node cleanly on the way out. The data stays in DIR: a
second ``up`` on it starts the same cluster again. What the operator can fix (a busy port, mariadbd or
Galera missing, a DIR the nodes cannot use) is one line on stderr and exit code 2; a node that does not
come up is one line and exit code 1.
"""

from __future__ import annotations

import sys

from launchers.cli import Command
from launchers.galera.cluster import GaleraCluster, galera_cluster, ports_from
from launchers.galera.node import GALERA


def ready(cluster: GaleraCluster, database: str, took: float) -> None:
    """The URL on stdout; on stderr, how long the nodes took."""
    print(cluster.url(database), flush=True)
    nodes = len(cluster.nodes)
    print(f"galera: {nodes} node(s) Synced in {took:.1f} s; Ctrl-C stops them", file=sys.stderr, flush=True)


COMMAND = Command(
    GALERA, galera_cluster, ports_from, ready, count="nodes", most=9, port=33061,
    limits="--nodes is 1 to 9, and --port leaves 4 ports a node below 65536",
    description="A Galera cluster on this machine.",
    up_help="start the nodes, print their URL, run until Ctrl-C or SIGTERM",
    port_help="node 0's SQL port (default 33061); node i's is PORT+i, then 3 Galera ports a node above them",
    database_help="made if missing; the URL's (default redpacket)",
)  # fmt: skip
main = COMMAND.main

if __name__ == "__main__":
    sys.exit(main())
