"""A MariaDB Galera cluster on one machine, for tests and for people: N ``mariadbd`` nodes (3 by default),
each with its own option file (``nodeN.cnf``; the system's ``/etc/mysql/my.cnf`` is never read), data
directory, log (``nodeN.err``) and four ports: SQL, group communication (gcomm), IST and SST.

    async with galera_cluster(Path("/var/tmp/galera")) as cluster:
        await cluster.create_database("redpacket")
        url = cluster.url("redpacket")  # mysql://root@127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3/redpacket

or from a shell, until Ctrl-C or SIGTERM: ``python -m launchers.galera up DIR [--nodes 3] [--port
33061]`` (prints the URL; ``__main__``).

Run as root, the nodes run as the ``mysql`` user (as root, rsync SST fails: the joiner's rsync drops to
``nobody``): the directory is given to ``mysql``, and every directory above it must let ``mysql`` in —
when one does not (pytest's ``tmp_path`` sits in a mode-700 directory), the cluster puts the nodes
in a fresh ``redpacket-galera-*`` directory of the system's temp dir instead, removed at ``close``
(``cluster.home`` says where). Run as anyone else, the nodes run as that user. The root account has no
password and answers on 127.0.0.1 over TCP.

A node killed with ``kill -9`` while others run comes back through ``rejoin``: its last committed
position is recovered first (``mariadbd --wsrep-recover``), so a donor sends what it missed (IST) rather
than a copy of everything (SST). When every node was killed, ``start`` bootstraps the most advanced one
(it marks ``safe_to_bootstrap: 1`` in its ``grastate.dat``) and the others join it.

``node`` is one node (its options, its start, its status); ``cluster`` starts and sizes them; what they
share with the Spider tool (a server's process, the servers' directory and closing, the command) is in
``launchers.node``, ``launchers.cluster``, ``launchers.cli`` and ``launchers.mariadbd``.

Errors::

    GaleraError             a node did not come up, did not sync, or died (with its log's last lines)
    └── GaleraSetupError    what the operator fixes before anything starts: a busy port, mariadbd or
                            the Galera library missing, a directory the nodes cannot use

Cancelling ``start`` stops what it started; ``close`` stops every node, paused or not, and never leaves
a ``mariadbd`` running.
"""

from __future__ import annotations

from launchers.galera.cluster import GaleraCluster, galera_cluster, ports_from
from launchers.galera.node import PROVIDER, GaleraError, GaleraNode, GaleraSetupError
from launchers.mariadbd import pick_ports

__all__ = [
    "PROVIDER",
    "GaleraCluster",
    "GaleraError",
    "GaleraNode",
    "GaleraSetupError",
    "galera_cluster",
    "pick_ports",
    "ports_from",
]
