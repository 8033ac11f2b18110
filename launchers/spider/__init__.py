"""A sharded MariaDB on one machine, for tests and for people: one Spider **head** (``mariadbd`` with the
Spider engine loaded) and N **backends** (3 by default), plain ``mariadbd`` processes, each with its own
data directory, port, socket and log (``head.err``, ``backendN.err``) under one directory; the system's
``/etc/mysql/my.cnf`` is never read.

    async with spider_cluster(Path("/var/tmp/spider")) as cluster:
        await cluster.create_database("redpacket")       # on the head and on every backend
        cluster.head_url("redpacket")                    # mysql://root@127.0.0.1:P0/redpacket
        cluster.shards_setting("redpacket")              # mysql://root@127.0.0.1:P1/redpacket,...

or from a shell, until Ctrl-C or SIGTERM: ``python -m launchers.spider up DIR [--backends 3] [--port
33071]`` (prints the two settings to export; ``__main__``).

The tool runs the processes and makes empty databases; the Spider servers (``CREATE SERVER``) and tables
are the ledger's migrations' to make. Through the head, a query that touches a backend that is down
fails in ~2 s with error 1429 (``Unable to connect to foreign data source``) while the others answer;
the head reconnects by itself once the backend is back — ``kill()`` then ``start()`` it (InnoDB recovers
what the kill cut off).

Run as root, the servers run as the ``mysql`` user, who must own the data directories and the
directory of the sockets: the directory is given to ``mysql``, and every directory above it must let
``mysql`` in — when one does not (pytest's ``tmp_path`` sits in a mode-700 directory), the servers go in
a fresh ``redpacket-spider-*`` directory of the system's temp dir instead, removed at ``close``
(``cluster.home`` says where). Run as anyone else, they run as that user. The root account has no
password and answers on 127.0.0.1 over TCP.

``node`` is one server (its options, its start); ``cluster`` starts and names them; what they share with
the Galera tool (a server's process, the servers' directory and closing, the command) is in
``launchers.node``, ``launchers.cluster``, ``launchers.cli`` and ``launchers.mariadbd``.

Errors::

    SpiderError             a server did not come up, the head has no Spider engine, or a server died
    │                       (with its log's last lines)
    └── SpiderSetupError    what the operator fixes before anything starts: a busy port, mariadbd or the
                            Spider plugin missing, a directory the servers cannot use

Cancelling ``start`` stops what it started; ``close`` stops every server, paused or not, and never
leaves a ``mariadbd`` running.
"""

from __future__ import annotations

from launchers.spider.cluster import SpiderCluster, ports_from, spider_cluster
from launchers.spider.node import PLUGIN, SpiderError, SpiderNode, SpiderSetupError

__all__ = [
    "PLUGIN",
    "SpiderCluster",
    "SpiderError",
    "SpiderNode",
    "SpiderSetupError",
    "ports_from",
    "spider_cluster",
]
