"""Our packed Redis connections (``server.store.redisconn``) of the kind each URL asks for."""

from __future__ import annotations


def test_rediss_and_unix_urls_get_packed_connections_of_their_kind() -> None:
    """Before: the packed class replaced whatever redis-py chose, so rediss:// went without TLS."""
    from redis.asyncio.connection import SSLConnection, UnixDomainSocketConnection

    from server.store.redisconn import PackedSSLConnection, PackedUnixConnection, packed_pool
    from server.store.redisnodes import RedisNodes

    for url, kind in (
        ("redis://127.0.0.1:6379/0", None),
        ("rediss://127.0.0.1:6380/0", SSLConnection),
        ("unix:///tmp/r.sock", UnixDomainSocketConnection),
    ):
        pooled = packed_pool(url).connection_class
        dedicated = RedisNodes.connect_dedicated(RedisNodes(url, 1).dedicated("x"))
        for got in (pooled, type(dedicated)):
            if kind is None:
                assert not issubclass(got, SSLConnection | UnixDomainSocketConnection), (url, got)
            else:
                assert issubclass(got, kind) and got in (PackedSSLConnection, PackedUnixConnection), (
                    url,
                    got,
                )
