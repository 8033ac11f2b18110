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

**Migrations.** Each backend holds every table and gets every migration. On the head, the other tables
get theirs; a statement that writes a sharded table (``written_table``, which refuses one it cannot
place) is skipped there, and the Spider table it wrote is made again from backend 0's new definition
(an ALTER on the head would change the link alone; dropping a Spider table drops the link, never the
backends' rows). ``make_sharded`` says in which order, and why a run stopped half-way can run again.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable

from server.store.db import Database, DatabaseError, as_text
from server.store.mysqlkit import parse_url
from server.store.schema import migrate, migration_lease, pending, statements

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


def spider_table(create: str, table: str, column: str, servers: list[str], *, name: str = "") -> str:
    """The head's Spider definition of ``table`` from its InnoDB ``SHOW CREATE TABLE``: the same columns
    and keys (unique ones widened by ``column``), partitioned by ``HASH(column)``, partition i on
    ``servers[i]``; named ``name`` on the head (``table`` by default: the backends' name either way)."""
    body, _, _ = create.rpartition(")")
    lines = [_widen(line, column) for line in body.splitlines()]
    lines[0] = f"CREATE TABLE `{name or table}` ("
    parts = ", ".join(f"PARTITION p{i} COMMENT = 'srv \"{s}\"'" for i, s in enumerate(servers))
    return (
        "\n".join(lines)
        + "\n) ENGINE=SPIDER DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin"
        + f' COMMENT = \'wrapper "mysql", table "{table}"\''
        + f" PARTITION BY HASH (`{column}`) ({parts})"
    )


# The statements a migration may hold on a sharded ledger, and the table each writes: one that writes a
# sharded table runs on the backends only (on the head, an UPDATE would reach the backends a second time
# and an ALTER change the link alone), the rest on the head too. What follows the table is checked, so a
# statement writing two tables (``UPDATE a JOIN b``, ``DROP TABLE a, b``, ``RENAME``) is refused, not
# guessed at.
_WRITES = re.compile(
    r"""\s*(?:(?:CREATE|ALTER|DROP)\s+TABLE(?:\s+IF\s+(?:NOT\s+)?EXISTS)?
          |(?:CREATE\s+(?:UNIQUE\s+)?|DROP\s+)INDEX(?:\s+IF\s+(?:NOT\s+)?EXISTS)?\s+`?\w+`?\s+ON
          |INSERT\s+(?:IGNORE\s+)?INTO|UPDATE|DELETE\s+FROM)
        \s+`?(\w+)`?(?=\s*(?:\(|(?:SET|WHERE|SELECT|VALUES|ADD|MODIFY|CHANGE|ALTER|DROP)\s|$))""",
    re.IGNORECASE | re.VERBOSE,
)


def written_table(sql: str) -> str:
    """The table a migration's statement writes: ``CREATE``/``ALTER``/``DROP TABLE x``, ``CREATE``/``DROP
    INDEX … ON x``, ``INSERT INTO x``, ``UPDATE x SET``, ``DELETE FROM x``. Any other statement, one
    holding ``;``, and one that writes a sharded table while reading another (on a backend it would read
    one shard's rows, and the backend's stale copies of the head's tables) raise ``DatabaseError``."""
    m = _WRITES.match(sql)
    if m is None or ";" in sql:
        raise DatabaseError(
            f"cannot tell which table this migration statement writes, so not where to run it on a sharded"
            f" ledger: {' '.join(sql.split())[:120]!r} (one table each: CREATE/ALTER/DROP TABLE x,"
            " CREATE/DROP INDEX … ON x, INSERT INTO x, UPDATE x SET, DELETE FROM x)"
        )
    table = m.group(1).lower()
    if table in SHARDED and re.search(r"\b(?:FROM|JOIN)\b", sql[m.end() :], re.IGNORECASE):
        raise DatabaseError(
            f"this migration statement writes the sharded table {table} from other tables, which a backend"
            f" sees only in part: {' '.join(sql.split())[:120]!r}"
        )
    return table


def runs_on_head(sql: str) -> bool:
    """Whether a migration's statement runs on the Spider head (``written_table``): not when it writes a
    sharded table, whose rows and definition are the backends'."""
    return written_table(sql) not in SHARDED


async def sharded_writes(head: Database) -> set[str]:
    """The sharded tables that the migrations the head has not applied write (``written_table``, so an
    unknown statement of theirs is refused here)."""
    tables = set()
    for version in await pending(head):
        for sql in statements(head.dialect, version):
            try:
                tables.add(written_table(sql))
            except DatabaseError as e:
                raise DatabaseError(f"migration {version}: {e}") from e
    return tables & SHARDED.keys()


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


async def _migrate_backends(
    backend_urls: list[str], connect: Callable[[str], Awaitable[Database]], done: list[str]
) -> dict[str, str]:
    """Every migration on each backend (its statements run there, data updates included); returns the
    sharded tables as backend 0 then has them, the schema's one source for the head's definitions."""
    creates: dict[str, str] = {}
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
    return creates


async def _swap(head: Database, table: str, definition: str, engines: dict[str, str]) -> None:
    """Replace the head's Spider table ``table`` by ``definition`` (named ``rp_new_<table>``), in one
    atomic RENAME: queries meanwhile see the old or the new link, never no table. Dropping a Spider
    table drops the link only; the backends keep their tables and rows."""
    new, old = f"rp_new_{table}", f"rp_old_{table}"
    for leftover in (new, old):  # a run stopped half-way left them
        if leftover in engines:
            if engines[leftover] != "SPIDER":
                raise DatabaseError(f"{leftover} on the head is not a Spider link: drop it yourself")
            await head.fetchall(f"DROP TABLE {leftover}")
    await head.fetchall(definition)
    await head.fetchall(f"RENAME TABLE {table} TO {old}, {new} TO {table}")
    await head.fetchall(f"DROP TABLE {old}")


async def _spider_tables(
    head: Database, creates: dict[str, str], servers: list[str], remake: set[str]
) -> list[str]:
    """Each sharded table of the head a Spider table over ``servers`` as the backends have it: made where
    there is none (or an empty one of another engine), made again where it is in ``remake``."""
    done = []
    engines = {
        as_text(r[0]): as_text(r[1])
        for r in await head.fetchall(
            "SELECT table_name, engine FROM information_schema.tables WHERE table_schema = DATABASE()"
        )
    }
    for table, column in SHARDED.items():
        if engines.get(table) == "SPIDER":
            if table in remake:
                again = spider_table(creates[table], table, column, servers, name=f"rp_new_{table}")
                await _swap(head, table, again, engines)
                done.append(f"head: {table} made again over the backends' new definition")
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


async def make_sharded(
    head: Database, head_database: str, backend_urls: list[str], connect: Callable[[str], Awaitable[Database]]
) -> list[str]:
    """Make, bring up to date, or check the sharded ledger; returns what was done, a line each.

    In this order, each step safe to run again after a crash: every migration on each backend (one left
    at the latest version is not changed again); the head's servers; then, under the head's migration
    lease, each sharded table of the head made a Spider table from backend 0's definition (made again
    when a migration the head has not applied writes it: ``sharded_writes``), and the head's migrations,
    the statements that write a sharded table skipped there (``runs_on_head``) — recorded last, so a run
    stopped before makes the definitions again. Refuses, before any backend is changed, a head sharded
    over another count or other backends, and a migration statement ``written_table`` cannot place; and
    a head whose tables to turn already hold rows (a ledger is not moved). ``connect``: opens a backend
    by its URL."""
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
    await sharded_writes(head)  # an unknown statement is refused before any backend is changed
    done: list[str] = []
    creates = await _migrate_backends(backend_urls, connect, done)
    for name, url in zip(servers, backend_urls, strict=True):
        t = parse_url(url)
        host, port = t.hosts[0]
        await head.fetchall(
            f"CREATE OR REPLACE SERVER {name} FOREIGN DATA WRAPPER mysql OPTIONS (HOST {_quoted(host)},"
            f" PORT {port}, USER {_quoted(t.user)}, PASSWORD {_quoted(t.password)},"
            f" DATABASE {_quoted(t.database)})"
        )
    async with migration_lease(head) as holder:
        # The definitions first: a head statement of these migrations may read a sharded table.
        done += await _spider_tables(head, creates, servers, await sharded_writes(head))
        applied = await migrate(head, runs_here=runs_on_head, lease=holder)
    done.append(f"head: migrations applied {applied or 'none'}")
    return done
