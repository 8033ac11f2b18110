"""Open the ledger's database named by a URL: MySQL/MariaDB (one server, a Galera cluster's nodes, or
the head of a sharded ledger on MariaDB Spider) or SQLite."""

from __future__ import annotations

from server.store import shards
from server.store.db import Database
from server.store.mysql import MySQLDatabase
from server.store.sqlite import SQLiteDatabase


async def connect(url: str, pool_size: int = 10, statement_timeout: float = 10.0) -> Database:
    """Open the database named by ``url``: ``mysql://user:pass@host:port,host:port/db`` (one server, or
    the nodes of a Galera cluster: ``server.store.mysql``) or ``sqlite:///path``. ``statement_timeout``:
    how long a MySQL statement may take before its node is looked at again (seconds)."""
    scheme = url.split(":", 1)[0]
    if scheme in ("mysql", "mariadb", "mysql+aiomysql"):
        db = await MySQLDatabase.connect(url, pool_size, statement_timeout)
        try:
            db.shards = await shards.count(db)  # the head's own table definitions say (a Spider head)
        except BaseException:
            await db.close()
            raise
        return db
    if scheme == "sqlite":
        return await SQLiteDatabase.connect(url[len("sqlite:///") :] or ":memory:")
    raise ValueError(f"unsupported database URL scheme {scheme!r}: use mysql:// or sqlite:///")
