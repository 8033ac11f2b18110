"""The Redis behind ``REDPACKET_REDIS_URL``: one server (``redis://``, ``rediss://``, ``unix://``) or a Redis
Cluster (``redis+cluster://host:port,host:port,…``), chosen by URL; the same code runs on both.

- ``client``: keyed commands, scripts and pipelines; on a cluster they are routed by slot (every script
  touches one slot: ``server.store.keys``).
- ``node_client(key)``: a plain client of the master that owns a key's slot, for a batch that must end
  with ``WAIT`` / ``WAITAOF`` on the same connection as its writes (durable grabs, ``server.store.batch``).
- ``dedicated(key)``: how to open a connection of one's own to the master of a key's slot (sharded pub/sub
  subscribes per master, ``server.hub.subscriber``).
- ``refresh()``: read the cluster's slot map again (after ``MOVED``, or a failover).
- ``generation``: goes up whenever a server's data may not be what this process last saw there — a
  restart (another run id), a failover, or a node that was demoted to replica and promoted again (it
  keeps its run id, but its data was replaced by its master's: its role and replication id change). Redis
  may have lost writes then, so packets are checked against the database before anyone grabs them again
  (``server.money.grabs.grab``). Each connection reads the run id, role and replication id when it
  connects, and refuses to be used if they changed (``ServerChanged``); and a pipeline that carries a
  grab is preceded by a read of the role and replication id whenever the last was more than
  ``LOOK_FIRST_AFTER`` ago, or the server answered as a replica or moved a slot since
  (``server.store.batch``), so a change on a connection already open is seen before a grab runs on the
  new data. What each answer says (run id, data id, replicas) is read in ``server.store.identities``.

Every connection packs commands with hiredis (C) and reads the server's identity as it connects
(``server.store.redisconn``).
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import urlparse

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from server.store.identities import (
    DATA_ID_COMMAND,
    LOOK_FIRST_AFTER,
    NOT_A_NODE,
    Identities,
    cluster_rows,
    data_id,
    info_field,
    replicas_to_wait_for,
)
from server.store.redisconn import Packed, PackedConnection, address_of, packed_class, packed_pool

CLUSTER_SCHEME = "redis+cluster://"


class Evicting(RedisConnectionError):
    """A master that may drop keys under memory pressure (``identities.eviction_problem``): nothing that
    holds a grab is sent to it, answered ``redis_unavailable`` until its policy is ``noeviction``."""


@dataclass(frozen=True)
class MasterUsage:
    """One master as the worker's gauges show it."""

    cpu: float  # CPU seconds (user + system) used so far
    memory: int  # bytes used
    replicas: int  # replicas that could take its place (``replicas_to_wait_for``)
    appendfsync: str  # its setting ("" when CONFIG is refused)
    eviction: str  # its maxmemory-policy (``identities.eviction_problem``)


class _Snapshots(dict[str, ClusterNode]):
    """The cluster client's startup nodes, iterated over a copy. redis-py 5.3's reading of the slot map
    loops over them awaiting each, while a command that lost its node pops that node from them outside
    any lock (redis/redis-py#3565): "dictionary changed size during iteration", seen at a master's kill
    failing the reading and, through it, the hub's writes of grab attempts."""

    # (a narrower return than the dict's own values(): the cluster client reads it as a list.)
    def values(self) -> list[ClusterNode]:  # type: ignore[override]
        return list(super().values())


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

    def __init__(self, url: str, pool_size: int, timeout: float = 5.0) -> None:
        """``timeout``: seconds any command may go unanswered before it fails and its connection is dropped
        (a Redis that hangs: stopped, or a network that drops packets), and the longest wait for a
        connection or a connect (a Redis that is down refuses at once; an unreachable one would hang
        for the OS's minutes-long connect timeout)."""
        self.url = url
        self.pool_size = pool_size
        self.timeout = timeout
        self.identities = Identities()
        self.cluster = is_cluster_url(url)
        common: dict[str, Any] = {"socket_connect_timeout": timeout, "socket_timeout": timeout}
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
                # While one master's slots fail over, the others' keep serving (docs/scaling.md).
                require_full_coverage=False,
                **common,
            )
            # The nodes' connections are made from these (RedisCluster takes no connection class).
            cluster.nodes_manager.connection_kwargs.update(
                connection_class=PackedConnection, identities=self.identities
            )
            manager = cluster.nodes_manager
            manager.startup_nodes = _Snapshots(manager.startup_nodes)
            self.client: Redis = cast(Redis, cluster)
        else:
            pool = packed_pool(
                url,
                max_connections=pool_size,
                timeout=math.ceil(timeout),
                identities=self.identities,
                **common,
            )
            self.client = Redis(connection_pool=pool)

    @property
    def generation(self) -> int:
        return self.identities.generation

    async def look(self, client: Redis, replicas: bool = False) -> None:
        """Read a server's data id (``DATA_ID_COMMAND``): a change raises the generation. With
        ``replicas``, count the replicas that could take its place too (``replicas_to_wait_for``; on a
        cluster its ``CLUSTER NODES`` is read in the same round trip)."""
        async with client.pipeline(transaction=False) as pipe:
            pipe.execute_command(DATA_ID_COMMAND)
            if replicas and self.cluster:
                pipe.execute_command("CLUSTER", "NODES")  # (as two words: no reply callback)
            answers = await pipe.execute()
        address = self._address(client)
        if replicas:
            count = replicas_to_wait_for(*answers)
            if count is None:
                self.identities.replicas.pop(address, None)  # not counted: waited for
            else:
                self.identities.replicas[address] = count
        self.identities.saw(address, data=data_id(answers[0]))
        self.identities.saw_policy(address, answers[0])

    def data_stamp(self, key: str) -> str:
        """The server that owns ``key``'s slot as this process last met it — its run id and data id — or ""
        before it has (``server.store.repair``). Always "" on a cluster: a slot moved to another master
        and back carries a stamp that names its first master again, whatever happened on the other
        one in between, and no identity changes with it."""
        if self.cluster:
            return ""
        seen = self.identities.seen.get(self._address(self.node_client(key)))
        return f"{seen[0]}/{seen[1]}" if seen is not None and seen[0] and seen[1] else ""

    def replicas(self, client: Redis) -> int | None:
        """How many replicas could take this server's place at the last look that counted them (None:
        not counted yet)."""
        return self.identities.replicas.get(self._address(client))

    async def read_policies(self, timeout: float) -> dict[str, str]:
        """Ask every master its eviction policy now, all at once, each within ``timeout`` seconds; the
        masters whose policy may drop keys, with it (``Identities.evicting``). Raises what the first
        failed with when none answers (on a cluster, one master failing over leaves the rest serving)."""

        async def ask(address: str, client: Redis) -> None:
            # (one word with its section: the raw text, no reply callback)
            info = await asyncio.wait_for(client.execute_command("INFO MEMORY"), timeout)  # type: ignore[no-untyped-call]
            self.identities.saw_policy(address, info)

        masters = self.masters()
        answers = await asyncio.gather(*(ask(a, c) for a, c in masters.items()), return_exceptions=True)
        failed = [a for a in answers if isinstance(a, BaseException)]
        if failed and len(failed) == len(answers):
            raise failed[0] if isinstance(failed[0], Exception) else RedisConnectionError("cancelled")
        return self.evicting_masters()

    def evicting_masters(self) -> dict[str, str]:
        """The masters of now whose last known policy may drop keys, with it (a server that was a master
        once and is gone is not counted)."""
        masters = self.masters()
        return {a: p for a, p in self.identities.evicting().items() if a in masters}

    def evicting(self, client: Redis) -> str | None:
        """This master's eviction policy if it may drop keys (as it last said), else None."""
        return self.identities.evicting().get(self._address(client))

    def look_first(self, client: Redis) -> bool:
        """Whether this server's data id was last read longer ago than ``LOOK_FIRST_AFTER``."""
        looked = self.identities.looked.get(self._address(client))
        return looked is None or time.monotonic() - looked > LOOK_FIRST_AFTER

    def look_again(self, client: Redis) -> None:
        """The next pipeline with a grab in it to this server reads its data id first."""
        self.identities.looked.pop(self._address(client), None)

    @staticmethod
    def _address(client: Redis) -> str:
        # Named as its connections name themselves (``where``): a unix socket by its path, else host:port
        # with redis-py's own defaults.
        kwargs = client.connection_pool.connection_kwargs
        if kwargs.get("path"):
            return str(kwargs["path"])
        return address_of(kwargs.get("host", "localhost"), kwargs.get("port", 6379))

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
                timeout=math.ceil(self.timeout),  # (redis-py takes whole seconds here)
                connection_class=PackedConnection,
                identities=self.identities,
                socket_connect_timeout=self.timeout,
                socket_timeout=self.timeout,
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

    async def replicas_known(self) -> dict[str, Redis]:
        """A plain client of every replica in the cluster's nodes list but those it agrees failed, by
        ``host:port`` (read from one master); none on a single server (its replicas' addresses are theirs
        to know). From CLUSTER NODES: CLUSTER SLOTS leaves out a replica of a master that never wrote."""
        if not self.cluster:
            return {}
        client = next(iter(self.masters().values()))
        out = {}
        # (redis-py's execute_command is not annotated.)
        for row in cluster_rows(await client.execute_command("CLUSTER", "NODES")):  # type: ignore[no-untyped-call]
            flags = set(row[2].split(","))
            if "slave" in flags and not flags & (NOT_A_NODE | {"fail"}):
                host, _, port = row[1].split("@", 1)[0].rpartition(":")
                out[f"{host}:{port}"] = self._node(host, int(port))
        return out

    async def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds (user + system) each master has used so far, by ``host:port``."""
        return {address: u.cpu for address, u in (await self.usage()).items()}

    async def usage(self) -> dict[str, MasterUsage]:
        """What each master has used and how its grabs are kept (``MasterUsage``), by ``host:port``: one
        round trip each (INFO, CONFIG GET appendfsync, and CLUSTER NODES on a cluster)."""
        out = {}
        for address, client in self.masters().items():
            async with client.pipeline(transaction=False) as pipe:
                pipe.execute_command("INFO DEFAULT")  # (one word: its raw text, no reply callback)
                pipe.execute_command("CONFIG", "GET", "appendfsync")
                if self.cluster:
                    pipe.execute_command("CLUSTER", "NODES")
                info, fsync, *nodes = await pipe.execute(raise_on_error=False)
            for answer in (info, *nodes):
                if isinstance(answer, Exception):
                    raise answer
            text = info.decode()
            self.identities.saw_policy(address, text)
            # CONFIG renamed or refused (a managed server): what it is set to is unknown ("").
            fsync_value = fsync[1].decode() if isinstance(fsync, list) and len(fsync) == 2 else ""
            replicas = replicas_to_wait_for(text, nodes[0] if nodes else None)
            if replicas is None:
                raise RedisError(f"Redis at {address} did not say its replicas")
            out[address] = MasterUsage(
                cpu=float(info_field(text, "used_cpu_user:")) + float(info_field(text, "used_cpu_sys:")),
                memory=int(info_field(text, "used_memory:")),
                replicas=replicas,
                appendfsync=fsync_value,
                eviction=info_field(text, "maxmemory_policy:"),
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
        subscriber): ``connect_dedicated(dedicated(key))``."""
        if not self.cluster:
            pool = cast(BlockingConnectionPool, self.client.connection_pool)
            kwargs = {**pool.connection_kwargs, "connection_class": pool.connection_class}
        else:
            cluster = cast(RedisCluster, self.client)
            node = cluster.nodes_manager.get_node_from_slot(cluster.keyslot(key))
            kwargs = {**cluster.nodes_manager.connection_kwargs, "host": node.host, "port": node.port}
        # (a subscriber's reads wait for whatever is published: its own pings find a silent server)
        kwargs["socket_timeout"] = None
        for k in ("max_connections", "response_callbacks"):
            kwargs.pop(k, None)
        # The class its pool makes (plain, TLS or Unix socket), packed: ``connect_dedicated`` uses it.
        kwargs["connection_class"] = packed_class(kwargs.get("connection_class", PackedConnection))
        kwargs["identities"] = self.identities
        return kwargs

    @staticmethod
    def connect_dedicated(kwargs: dict[str, Any]) -> Packed:
        """A connection (not yet connected) from what ``dedicated`` returned."""
        options = dict(kwargs)
        cls: type[Packed] = options.pop("connection_class")
        return cls(**options)

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
            cluster = cast(RedisCluster, self.client)
            # Re-read under the client's own lock, as it does after its own errors (the flag is how it
            # asks itself), not beside a reading of its own.
            cluster._initialize = True
            await cluster.initialize()

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
