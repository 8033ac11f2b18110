"""``python -m launchers.spider up DIR``: a Spider head and its backends on this machine until Ctrl-C
or SIGTERM.

Once every server answers and the database is made on each (kept if it exists), stdout gets one
comment line per server (``# head 127.0.0.1:33071 pid 4242 log DIR/head.err``), then the two settings
to export::

    REDPACKET_DATABASE_URL=mysql://root@127.0.0.1:33071/redpacket
    REDPACKET_SHARDS=mysql://root@127.0.0.1:33072/redpacket,mysql://root@127.0.0.1:33073/redpacket,...

(so stdout, saved to a file, can be sourced by a shell). On the way out every server is stopped cleanly.
The data stays in DIR: a second ``up`` on it starts the same servers again. What the operator can fix
(a busy port, mariadbd or the Spider plugin missing, a DIR the servers cannot use) is one line on
stderr and exit code 2; a server that does not come up is one line and exit code 1.
"""

from __future__ import annotations

import sys

from launchers.cli import Command
from launchers.spider.cluster import SpiderCluster, ports_from, spider_cluster
from launchers.spider.node import SPIDER

BASE_PORT = 33071  # the Galera tool's nodes take 33061 and up


def ready(cluster: SpiderCluster, database: str, took: float) -> None:
    """A comment line a server, then the two settings, on stdout; on stderr, how long they took."""
    for node in cluster.nodes:
        print(f"# {node.name} {node.address} pid {node.pid} log {node.log}")
    print(f"REDPACKET_DATABASE_URL={cluster.head_url(database)}")
    print(f"REDPACKET_SHARDS={cluster.shards_setting(database)}", flush=True)
    print(
        f"spider: a head and {len(cluster.backends)} backend(s) up in {took:.1f} s; Ctrl-C stops them",
        file=sys.stderr, flush=True,
    )  # fmt: skip


COMMAND = Command(
    SPIDER, spider_cluster, ports_from, ready, count="backends", most=64, port=BASE_PORT,
    limits="--backends is 1 to 64, and --port leaves a port a backend below 65536",
    description="A Spider head and its backends on this machine.",
    up_help="start the servers, print the settings to export, run until Ctrl-C or SIGTERM",
    port_help=f"the head's port (default {BASE_PORT}); backend i's is PORT+1+i",
    database_help="made on every server if missing (default redpacket)",
)  # fmt: skip
main = COMMAND.main

if __name__ == "__main__":
    sys.exit(main())
