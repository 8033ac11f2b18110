"""The Redis behind ``REDPACKET_REDIS_URL``: one server (``redis://``, ``rediss://``, ``unix://``) or a Redis
Cluster (``redis+cluster://host:port,host:port,…``), chosen by URL; the same code runs on both.

- ``client``: keyed commands, scripts and pipelines; on a cluster they are routed by slot (every script
  touches one slot: ``server.store.keys``).
- ``node_client(key)``: a plain client of the master that owns a key's slot, for a batch that must end
  with ``WAIT`` / ``WAITAOF`` on the same connection as its writes (durable grabs, ``server.store.batch``).
- ``dedicated(key)``: how to open a connection of one's own to the master of a key's slot (sharded pub/sub
  subscribes per master, ``server.hub.subscriber``).
- ``refresh()``: read the cluster's slot map again (after ``MOVED``, or a failover).
- ``generation``: goes up whenever a connection finds a server this process has not seen under that run
  id — a restart or a failover. Redis may have lost writes then, so packets are checked against the
  database before anyone grabs them again (``server.money.grabs.grab``). Each connection reads the run id
  when it connects, before any command is sent on it, so no grab reaches a restarted server unseen.

Every connection packs commands with hiredis (C) instead of redis-py's Python packer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import urlparse

import hiredis
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import Connection

log = logging.getLogger(__name__)

CLUSTER_SCHEME = "redis+cluster://"


@dataclass
class Identities:
    """Which server answered at each address (its run id), and a generation that counts changes."""

    seen: dict[str, str] = field(default_factory=dict)
    generation: int = 0

    def saw(self, address: str, run_id: str) -> None:
        if self.seen.get(address) != run_id:
            if address in self.seen:
                log.warning(
                    "Redis at %s is a new server (run id %s): packets are checked again", address, run_id
                )
            self.seen[address] = run_id
            self.generation += 1


class PackedConnection(Connection):
    """A Redis connection that packs commands with hiredis (under a grab storm redis-py's own packer was a
    third of the hub's time; same bytes on the wire; multi-word command names are split as redis-py does)
    and reports the run id of the server it connected to before it is used."""

    def __init__(self, *args: Any, identities: Identities | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._identities = identities

    def pack_command(self, *args: Any) -> list[bytes]:
        head = args[0]
        if isinstance(head, str) and " " in head:
            args = (*head.split(), *args[1:])
        elif isinstance(head, bytes) and b" " in head:
            args = (*head.split(), *args[1:])
        return [hiredis.pack_command(args)]

    async def on_connect(self) -> None:
        await super().on_connect()
        if self._identities is not None:
            await self.send_command("INFO", "server")
            info = await self.read_response()
            text = info.decode() if isinstance(info, bytes) else str(info)
            run_id = next((line[7:].strip() for line in text.splitlines() if line.startswith("run_id:")), "")
            self._identities.saw(f"{self.host}:{self.port}", run_id)


def is_cluster_url(url: str) -> bool:
    return url.startswith(CLUSTER_SCHEME)


def _cluster_nodes(url: str) -> list[tuple[str, int]]:
    hosts = url[len(CLUSTER_SCHEME) :].split("/", 1)[0]
    nodes = []
    for part in hosts.split(","):
        u = urlparse(f"redis://{part}")
        nodes.append((u.hostname or "127.0.0.1", u.port or 6379))
    return nodes


class RedisNodes:
    """The Redis (or Redis Cluster) of one URL for this process. Use ``await open()`` / ``aclose()``."""

    def __init__(self, url: str, pool_size: int) -> None:
        self.url = url
        self.pool_size = pool_size
        self.identities = Identities()
        self.cluster = is_cluster_url(url)
        common: dict[str, Any] = {
            # A Redis that is down refuses at once; an unreachable one must not hang a request for the
            # OS's minutes-long connect timeout.
            "socket_connect_timeout": 5,
        }
        self._nodes: dict[str, Redis] = {}
        self._refreshing = asyncio.Lock()
        self._refreshed = 0.0
        if self.cluster:
            startup = [ClusterNode(host, port) for host, port in _cluster_nodes(url)]
            # The cluster client's nodes refuse a connection past max_connections instead of waiting for
            # one: the hot paths go through the batcher (per-master blocking pools of pool_size), and
            # this bound is for everything else.
            cluster = RedisCluster(
                startup_nodes=startup,
                max_connections=pool_size * 8,
                connection_error_retry_attempts=0,
                **common,
            )
            # The nodes' connections are made from these (RedisCluster takes no connection class).
            cluster.nodes_manager.connection_kwargs.update(
                connection_class=PackedConnection, identities=self.identities
            )
            self.client: Redis = cast(Redis, cluster)
        else:
            pool = BlockingConnectionPool.from_url(
                url,
                max_connections=pool_size,
                timeout=10,
                connection_class=PackedConnection,
                identities=self.identities,
                **common,
            )
            self.client = Redis(connection_pool=pool)

    @property
    def generation(self) -> int:
        return self.identities.generation

    async def open(self) -> RedisNodes:
        """Learn the cluster's slot map and meet every master now, so that the servers this process
        starts with are known before its first grab (a server met later means a failover or a restart)."""
        if self.cluster:
            cluster = cast(RedisCluster, self.client)
            await cluster.initialize()
            for node in cluster.get_primaries():
                await self._node(node.host, int(node.port)).ping()
        else:
            await self.client.ping()
        return self

    def node_client(self, key: str | bytes) -> Redis:
        """The plain client of the master that owns ``key``'s slot (the one client on a single server)."""
        if not self.cluster:
            return self.client
        cluster = cast(RedisCluster, self.client)
        node = cluster.nodes_manager.get_node_from_slot(cluster.keyslot(key))
        return self._node(node.host, int(node.port))

    def at(self, address: str) -> Redis:
        """The plain client of the node at ``host:port`` (a MOVED answer's target)."""
        host, _, port = address.rpartition(":")
        return self._node(host, int(port)) if self.cluster else self.client

    def _node(self, host: str, port: int) -> Redis:
        name = f"{host}:{port}"
        client = self._nodes.get(name)
        if client is None:
            pool = BlockingConnectionPool(
                host=host,
                port=port,
                max_connections=self.pool_size,
                timeout=10,
                connection_class=PackedConnection,
                identities=self.identities,
                socket_connect_timeout=5,
            )
            client = self._nodes[name] = Redis(connection_pool=pool)
        return client

    def masters(self) -> dict[str, Redis]:
        """A plain client of every master, by ``host:port`` (the one server's client on a single server)."""
        if not self.cluster:
            kwargs = cast(BlockingConnectionPool, self.client.connection_pool).connection_kwargs
            return {self.address(kwargs): self.client}
        return {
            f"{n.host}:{n.port}": self._node(n.host, int(n.port))
            for n in cast(RedisCluster, self.client).get_primaries()
        }

    async def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds (user + system) each master has used so far, by ``host:port``."""
        return {address: cpu for address, (cpu, _) in (await self.usage()).items()}

    async def usage(self) -> dict[str, tuple[float, int]]:
        """(CPU seconds used so far, memory used in bytes) of each master, by ``host:port``: one INFO
        each (its default sections hold both)."""
        out = {}
        for address, client in self.masters().items():
            info = await client.info()
            out[address] = (
                float(info["used_cpu_user"]) + float(info["used_cpu_sys"]),
                int(info["used_memory"]),
            )
        return out

    def connections_in_use(self) -> int:
        """Connections of the per-master pools lent out right now (the grab path's pipelines)."""
        return sum(
            len(getattr(client.connection_pool, "_in_use_connections", ()))
            for client in self.masters().values()
        )

    def dedicated(self, key: str | bytes) -> dict[str, Any]:
        """What a connection of its own to the master owning ``key``'s slot is made from (a sharded pub/sub
        subscriber): ``PackedConnection(**dedicated(key))``."""
        if not self.cluster:
            kwargs = dict(cast(BlockingConnectionPool, self.client.connection_pool).connection_kwargs)
        else:
            cluster = cast(RedisCluster, self.client)
            node = cluster.nodes_manager.get_node_from_slot(cluster.keyslot(key))
            kwargs = {**cluster.nodes_manager.connection_kwargs, "host": node.host, "port": node.port}
        for k in ("connection_class", "max_connections", "response_callbacks"):
            kwargs.pop(k, None)
        kwargs["identities"] = self.identities
        return kwargs

    @staticmethod
    def address(kwargs: dict[str, Any]) -> str:
        """Where a ``dedicated`` connection goes: ``host:port`` (or the unix socket's path)."""
        return str(kwargs.get("path") or f"{kwargs.get('host', '127.0.0.1')}:{kwargs.get('port', 6379)}")

    async def refresh(self) -> None:
        """Read the slot map again (a failover, a slot moved); no-op on a single server. Concurrent
        callers share one reading, and it is read at most every half second."""
        if not self.cluster:
            return
        async with self._refreshing:
            if time.monotonic() - self._refreshed < 0.5:
                return
            self._refreshed = time.monotonic()
            await cast(RedisCluster, self.client).nodes_manager.initialize()

    async def aclose(self) -> None:
        for client in self._nodes.values():
            await client.aclose(close_connection_pool=True)
        self._nodes.clear()
        if self.cluster:
            await cast(RedisCluster, self.client).aclose()
        else:
            await self.client.aclose(close_connection_pool=True)


def moved(e: BaseException) -> bool:
    """A reply that says the slot lives elsewhere now (or the cluster is reconfiguring)."""
    return str(e).startswith(("MOVED", "ASK", "CLUSTERDOWN", "TRYAGAIN"))
