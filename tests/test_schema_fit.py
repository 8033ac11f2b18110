"""The schema is one Galera can replicate, and ``redpacket migrate`` refuses one it cannot: every table
InnoDB with a primary key, no named locks (``GET_LOCK``: Galera refuses it) and no ``LOCK TABLES`` —
migrations take turns through a lease row instead."""

from __future__ import annotations

import ast
import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import urlparse

import pymysql
import pytest

from server.store import schema
from server.store.db import Database, DatabaseError
from server.store.dialect import MYSQL
from server.store.engines import connect

ROOT = Path(__file__).resolve().parent.parent


BANNED = re.compile(r"GET_LOCK|RELEASE_LOCK|LOCK TABLES?|MyISAM|ENGINE\s*=\s*(?!InnoDB)", re.IGNORECASE)
LOCKS = re.compile(r"GET_LOCK|RELEASE_LOCK|LOCK TABLES?|MyISAM", re.IGNORECASE)


def _strings(path: Path) -> list[str]:
    """Every string constant of a module but its docstrings (which may name what is avoided)."""
    tree = ast.parse(path.read_text())
    docs = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
    ]


@pytest.mark.unit
def test_no_statement_takes_a_lock_galera_cannot_replicate_or_names_another_engine() -> None:
    assert BANNED.search("SELECT GET_LOCK('x', 1)") and BANNED.search("lock tables t write")  # it finds them
    assert BANNED.search(") ENGINE=MyISAM") and not BANNED.search(") ENGINE=InnoDB DEFAULT CHARSET=utf8mb4")
    # The one other engine: a Spider head's tables (they hold no rows; every row is on an InnoDB backend),
    # made in one module, and the tool that starts a head asks for it.
    spider = {ROOT / "server" / "store" / "shards.py", *(ROOT / "server" / "tools" / "spider").glob("*.py")}
    for path in [*(ROOT / "server").rglob("*.py"), *(ROOT / "worker").rglob("*.py")]:
        banned = LOCKS if path in spider else BANNED
        found = [s for s in _strings(path) if banned.search(s)]
        assert not found, (path, found)
    assert "ENGINE=InnoDB" in MYSQL.ddl["table_options"]


def fresh_database(mysql_url: str, name: str) -> str:
    """An empty database ``name`` on the MariaDB of ``mysql_url``: its URL."""
    u = urlparse(mysql_url)
    conn = pymysql.connect(host=u.hostname or "127.0.0.1", port=u.port or 3306, user=u.username or "root")
    with conn.cursor() as cur:
        cur.execute(f"DROP DATABASE IF EXISTS `{name}`")
        cur.execute(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4")
    conn.close()
    return u._replace(path=f"/{name}").geturl()


@pytest.fixture
async def fresh(mysql_url: str) -> AsyncIterator[Database]:
    db = await connect(fresh_database(mysql_url, "redpacket_test_fit"), 4)
    try:
        yield db
    finally:
        await db.close()


async def test_migrate_refuses_tables_galera_cannot_replicate_and_names_each(fresh: Database) -> None:
    await schema.migrate(fresh)
    assert await schema.unfit_for_galera(fresh) == []
    await fresh.fetchall("CREATE TABLE notes_no_key (body TEXT) ENGINE=InnoDB")
    await fresh.fetchall("CREATE TABLE notes_myisam (id INT PRIMARY KEY) ENGINE=MyISAM")
    with pytest.raises(DatabaseError) as e:
        await schema.migrate(fresh)
    said = str(e.value)
    assert "notes_no_key: no primary key" in said and "notes_myisam: engine MyISAM, not InnoDB" in said
    await fresh.fetchall("DROP TABLE notes_no_key, notes_myisam")
    assert await schema.migrate(fresh) == []


async def test_concurrent_migrations_take_turns_and_a_stale_lease_is_taken_over(fresh: Database) -> None:
    others = [await connect(_fresh_url(fresh), 2) for _ in range(3)]
    try:
        applied = await asyncio.gather(*(schema.migrate(db) for db in others))
        # Each migration was applied by exactly one of them; the others found it done.
        versions = sorted(v for done in applied for v in done)
        assert versions == [v for v, _, _ in schema.MIGRATIONS], applied
        assert await fresh.fetchall("SELECT * FROM schema_lease") == []
    finally:
        for db in others:
            await db.close()
    # A migrate killed while holding the lease: the next one takes it over once it is older than the lease.
    await fresh.fetchall(
        "INSERT INTO schema_lease (name, holder, taken_ms) VALUES ('migrate', 'dead', %s)",
        (schema.now_ms() - schema.LEASE_MS - 1,),
    )
    async with schema.migration_lease(fresh) as holder:
        rows = await fresh.fetchall("SELECT holder FROM schema_lease")
        assert len(rows) == 1 and rows[0][0] == holder != "dead"
        # Renewed on the migration's own connection before each statement: never taken over while held.
        await fresh.fetchall("UPDATE schema_lease SET taken_ms = 0")
        async with fresh.transaction() as tx:
            await schema.renew_lease(tx, holder)
        row = await fresh.fetchone("SELECT taken_ms FROM schema_lease")
        assert row is not None and int(row[0]) > schema.now_ms() - 60_000
    assert await fresh.fetchall("SELECT holder FROM schema_lease") == []


def _fresh_url(db: Database) -> str:
    target = db.target  # type: ignore[attr-defined]
    host, port = target.hosts[0]
    return f"mysql://{target.user}@{host}:{port}/{target.database}"


def _many_statements(path: Path) -> list[str]:
    """The SQL text of every ``executemany(...)`` call of a module whose statement is written out there."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "executemany"
        ):
            if node.args:
                parts = [n.value for n in ast.walk(node.args[0]) if isinstance(n, ast.Constant)]
                out.append("".join(p for p in parts if isinstance(p, str)))
    return out


@pytest.mark.unit
def test_every_batched_insert_is_all_placeholders() -> None:
    """aiomysql sends ``executemany`` as one multi-row INSERT only when every value is ``%s``; one literal
    among them and it sends a statement per row (measured: 1,012 statements for a 500-credit batch on a
    sharded ledger instead of 14). Literals go in as parameters."""
    shape = re.compile(r"VALUES \((%s, )*%s\)")
    found = []
    for path in [*(ROOT / "server").rglob("*.py"), *(ROOT / "worker").rglob("*.py")]:
        for sql in _many_statements(path):
            if "VALUES" in sql and not shape.search(sql):
                found.append((path.name, sql))
    assert not found, found
    assert shape.search("INSERT INTO t (a, b) VALUES (%s, %s)") and not shape.search("VALUES (%s, 'x')")
