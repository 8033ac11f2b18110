"""The ledger sharded over several MariaDB servers by MariaDB Spider: which table is sharded by what, which
shard a row lives on, and how ``redpacket migrate`` makes the Spider tables.

**The layout.** A Spider *head* (a MariaDB server with the Spider engine) holds every table. The tables of
money (``SHARDED``) are Spider tables there, partitioned ``BY HASH`` of one column over the *backends*
(``REDPACKET_SHARDS``), each backend an ordinary MariaDB holding the real InnoDB tables: a packet, its
shares, its grab records and its refused credits by the packet's id; an account, its journal, its events
and its holds by the user's id. The rest (users, groups, the event counter, webhook queues) are plain
InnoDB tables on the head. Processes connect to the head only; the shard count is read from the head's
own table definitions (``count``), so a process cannot disagree with the database about it.

``HASH(x)`` over N partitions puts a row on partition ``x mod N`` (``shard_of``): the code groups its
writes by that, and every transaction it runs writes rows of one shard only (``server.money.shardsteps``):
Spider commits a transaction that wrote on two backends backend by backend, not atomically (its XA is
off, and nothing here relies on it).

**Unique keys.** MariaDB makes every unique key of a partitioned table hold the partitioning column, so
on the head each is widened by it (``spider_table``); each backend keeps the key as written, so the keys
that refuse a double payment are enforced within a shard: ``grab_records`` (packet, user) and (packet,
seq) on the packet's shard; a journal key on its account's shard (a grab's key is refused twice for one
user; a share paid to another user is refused by the packet's shard first).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable

from server.store.db import Database, DatabaseError, as_text
from server.store.mysqlkit import parse_url
from server.store.schema import migrate, pending

# Each sharded table and the column its rows are placed by.
SHARDED: dict[str, str] = {
    "red_packets": "id",
    "red_packet_shares": "packet_id",
    "grab_records": "packet_id",
    "credit_refusals": "packet_id",
    "accounts": "user_id",
    "journal": "account_id",
    "events": "shard_id",
    "holds": "user_id",
}

COUNT_SQL = (
    "SELECT COUNT(*) FROM information_schema.partitions p JOIN information_schema.tables t"
    " ON t.table_schema = p.table_schema AND t.table_name = p.table_name"
    " WHERE p.table_schema = DATABASE() AND p.table_name = 'journal' AND t.engine LIKE 'SPIDER'"
    " AND p.partition_name IS NOT NULL"
)


def shard_of(key: int, shards: int) -> int:
    """The shard (backend index) of a row whose shard column holds ``key``: MariaDB's ``HASH`` over
    ``shards`` partitions. 0 when the ledger is not sharded."""
    return key % shards if shards else 0


def by_shard(keys: list[int], shards: int) -> dict[int, list[int]]:
    """``keys`` grouped by their shard, shards in order, each group in the given order."""
    out: dict[int, list[int]] = {}
    for k in keys:
        out.setdefault(shard_of(k, shards), []).append(k)
    return dict(sorted(out.items()))


def server_name(database: str, index: int) -> str:
    """The head's name for backend ``index``: server names are global to the head, so each carries the
    deployment's database name (two deployments on one head never share one)."""
    return f"rp_{database}_{index}"[:64]


def _widen(line: str, column: str) -> str:
    """A PRIMARY or UNIQUE KEY line of ``SHOW CREATE TABLE`` with ``column`` added when it lacks it."""
    m = re.match(r"(\s*(?:PRIMARY KEY|UNIQUE KEY `[^`]+`) \()([^)]*)(\).*)", line)
    if m is None or f"`{column}`" in m.group(2).split(","):
        return line
    return f"{m.group(1)}{m.group(2)},`{column}`{m.group(3)}"


def spider_table(create: str, table: str, column: str, servers: list[str]) -> str:
    """The head's Spider definition of ``table`` from its InnoDB ``SHOW CREATE TABLE``: the same columns
    and keys (unique ones widened by ``column``), partitioned by ``HASH(column)``, partition i on
    ``servers[i]``."""
    body, _, _ = create.rpartition(")")
    lines = [_widen(line, column) for line in body.splitlines()]
    parts = ", ".join(f"PARTITION p{i} COMMENT = 'srv \"{s}\"'" for i, s in enumerate(servers))
    return (
        "\n".join(lines)
        + "\n) ENGINE=SPIDER DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin"
        + f' COMMENT = \'wrapper "mysql", table "{table}"\''
        + f" PARTITION BY HASH (`{column}`) ({parts})"
    )


async def count(db: Database) -> int:
    """How many backends the ledger is sharded over; 0 for one database (or SQLite)."""
    if db.dialect.name != "mysql":
        return 0
    row = await db.fetchone(COUNT_SQL)
    return int(row[0]) if row else 0


async def _same_backends(head: Database, servers: list[str], backend_urls: list[str]) -> None:
    """Refuse a ``REDPACKET_SHARDS`` that names other backends, or the same in another order, than the
    head's partitions were made over: every shard would silently be read from the wrong server."""
    marks = ", ".join(["%s"] * len(servers))
    rows = await head.fetchall(
        f"SELECT Server_name, Host, Port, Db FROM mysql.servers WHERE Server_name IN ({marks})", servers
    )
    known = {as_text(n): (as_text(h), int(p), as_text(d)) for n, h, p, d in rows}
    for i, (name, url) in enumerate(zip(servers, backend_urls, strict=True)):
        t = parse_url(url)
        if known.get(name) != (*t.hosts[0], t.database):
            raise DatabaseError(
                f"shard {i} of this ledger is {known.get(name)}, and REDPACKET_SHARDS names {t.address(0)}/"
                f"{t.database} there: list the backends as the ledger was made over them, in that order"
            )


def _quoted(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


async def make_sharded(
    head: Database, head_database: str, backend_urls: list[str], connect: Callable[[str], Awaitable[Database]]
) -> list[str]:
    """Make (or check) the sharded ledger: every migration on each backend, the head's servers, the
    migrations on the head, then each sharded table of the head turned into a Spider table over the
    backends. Returns what was done, a line each. Refuses a head sharded over another count (resharding
    is not done here) and a head whose tables to turn already hold rows (a ledger is not moved).
    ``connect``: opens a backend by its URL."""
    if head.dialect.name != "mysql":
        raise DatabaseError("a sharded ledger needs a MariaDB head with the Spider engine, not SQLite")
    mode = await head.fetchone("SELECT @@global.spider_auto_increment_mode")
    if mode is None or int(mode[0]) != 1:
        raise DatabaseError(
            "the Spider head must run with spider_auto_increment_mode=1 (ids from its own counter, unique"
            " over the shards; the default locks a backend's table for every insert): add"
            " `spider-auto-increment-mode=1` to its configuration and restart it"
        )
    have = await count(head)
    if have and have != len(backend_urls):
        raise DatabaseError(
            f"the ledger is sharded over {have} backends and REDPACKET_SHARDS names {len(backend_urls)}:"
            " moving rows between shards is not done by migrate"
        )
    servers = [server_name(head_database, i) for i in range(len(backend_urls))]
    if have:
        await _same_backends(head, servers, backend_urls)
        if await pending(head):  # before any backend is changed
            raise DatabaseError(
                "a sharded ledger's later migrations are not applied by this version of migrate (the"
                " head's Spider definitions would not follow the backends): not done yet"
            )
    done: list[str] = []
    creates: dict[str, str] = {}  # the tables as the backends have them: the schema's one source
    for i, url in enumerate(backend_urls):
        backend = await connect(url)
        try:
            applied = await migrate(backend)
            if i == 0:
                for table in SHARDED:
                    (_, create), *_ = await backend.fetchall(f"SHOW CREATE TABLE {table}")
                    creates[table] = as_text(create)
        finally:
            await backend.close()
        done.append(f"shard {i} ({parse_url(url).address(0)}): migrations applied {applied or 'none'}")
    for name, url in zip(servers, backend_urls, strict=True):
        t = parse_url(url)
        host, port = t.hosts[0]
        await head.fetchall(
            f"CREATE OR REPLACE SERVER {name} FOREIGN DATA WRAPPER mysql OPTIONS (HOST {_quoted(host)},"
            f" PORT {port}, USER {_quoted(t.user)}, PASSWORD {_quoted(t.password)},"
            f" DATABASE {_quoted(t.database)})"
        )
    applied = await migrate(head)
    done.append(f"head: migrations applied {applied or 'none'}")
    engines = {
        as_text(r[0]): as_text(r[1])
        for r in await head.fetchall(
            "SELECT table_name, engine FROM information_schema.tables WHERE table_schema = DATABASE()"
        )
    }
    for table, column in SHARDED.items():
        if engines.get(table) == "SPIDER":
            continue
        if table in engines:
            if await head.fetchone(f"SELECT 1 FROM {table} LIMIT 1") is not None:
                raise DatabaseError(
                    f"{table} on the head already holds rows: a ledger is not moved onto shards by"
                    " migrate (start the sharded ledger on a new database)"
                )
            await head.fetchall(f"DROP TABLE {table}")
        # (A run stopped between the two finds the table gone, and makes it from the backends' copy.)
        await head.fetchall(spider_table(creates[table], table, column, servers))
        done.append(f"head: {table} sharded by {column} over {len(servers)} backends")
    return done
