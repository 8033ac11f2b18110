"""A connection to one Redis server as this process makes them: commands packed by hiredis (C) instead of
redis-py's Python packer, and the server's identity read as it connects (``ServerChanged`` when another
server, or other data, answers at an address it has met: ``server.store.identities``). Over TCP, TLS or a
Unix socket, as the URL says (``packed_pool``)."""

from __future__ import annotations

from typing import Any

import hiredis
from redis.asyncio import BlockingConnectionPool
from redis.asyncio.connection import Connection, SSLConnection, UnixDomainSocketConnection
from redis.exceptions import ConnectionError as RedisConnectionError

from server.store.identities import Identities, data_id


class ServerChanged(RedisConnectionError):
    """A new connection found another server at an address (another run id), or the same server with other
    data (role, replication id): nothing was sent on it, and the generation has risen. Check what must be
    checked against the database, then send again (the next connection goes through)."""


class _Packing:
    """A Redis connection that packs commands with hiredis (under a grab storm redis-py's own packer was a
    third of the hub's time; same bytes on the wire; multi-word command names are split as redis-py does)
    and reports the run id of the server it connected to before it is used."""

    def __init__(self, *args: Any, identities: Identities | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._identities = identities

    def where(self) -> str:
        """The server it connects to: ``host:port``, or a unix socket's path."""
        raise NotImplementedError

    def pack_command(self, *args: Any) -> list[bytes]:
        head = args[0]
        if isinstance(head, str) and " " in head:
            args = (*head.split(), *args[1:])
        elif isinstance(head, bytes) and b" " in head:
            args = (*head.split(), *args[1:])
        return [hiredis.pack_command(args)]

    async def on_connect(self) -> None:
        # (redis-py's connection classes are partly annotated: these methods are its own, untyped.)
        await super().on_connect()  # type: ignore[misc]
        if self._identities is not None:
            await self.send_command("INFO", "server", "replication", "memory")  # type: ignore[attr-defined]
            info = await self.read_response()  # type: ignore[attr-defined]
            text = info.decode() if isinstance(info, bytes) else str(info)
            run_id = next((line[7:].strip() for line in text.splitlines() if line.startswith("run_id:")), "")
            address = self.where()
            self._identities.saw_policy(address, text)  # (a server met again is checked again)
            if self._identities.saw(address, run_id, data_id(text), look=False):
                # Not a command goes out on it: what it would carry (a grab) was made for the data before.
                raise ServerChanged(f"Redis at {address} restarted or failed over: checked, then sent again")


class PackedConnection(_Packing, Connection):
    """``_Packing`` over TCP."""

    def where(self) -> str:
        return address_of(self.host, self.port)


class PackedUnixConnection(_Packing, UnixDomainSocketConnection):
    """``_Packing`` over a Unix socket (``unix://`` URLs)."""

    def where(self) -> str:
        return str(self.path)


class PackedSSLConnection(_Packing, SSLConnection):
    """``_Packing`` over TLS (``rediss://`` URLs)."""

    def where(self) -> str:
        return address_of(self.host, self.port)


Packed = PackedConnection | PackedUnixConnection | PackedSSLConnection


def packed_pool(url: str, **kwargs: Any) -> BlockingConnectionPool:
    """A blocking pool of packed connections to one server's URL (``redis://``, ``rediss://``, ``unix://``):
    the class ``from_url`` chose for the URL (plain, TLS or Unix socket; it puts its own over the one it
    is given), packed."""
    pool = BlockingConnectionPool.from_url(url, **kwargs)
    pool.connection_class = packed_class(pool.connection_class)
    return pool


def packed_class(base: type) -> type[Packed]:
    """The packed connection class for redis-py's ``base`` class: over TCP, TLS or a Unix socket."""
    if issubclass(base, SSLConnection):  # (before Connection, of which it is one)
        return PackedSSLConnection
    if issubclass(base, UnixDomainSocketConnection):
        return PackedUnixConnection
    return PackedConnection


def address_of(host: str, port: int) -> str:
    """How a server is named in ``Identities``: ``host:port``, as its connections were told."""
    return f"{host}:{port}"
