"""The schema's statements are ones Galera can replicate, read from the source: no named locks
(``GET_LOCK``), no ``LOCK TABLES``, no engine but InnoDB, and every batched insert all placeholders.
(``redpacket migrate`` refusing a schema Galera cannot take, on MariaDB: ``tests/test_schema_fit.py``.)"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from server.store.dialect import MYSQL
from tests.repofiles import ROOT

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


def test_no_statement_takes_a_lock_galera_cannot_replicate_or_names_another_engine() -> None:
    assert BANNED.search("SELECT GET_LOCK('x', 1)") and BANNED.search("lock tables t write")  # it finds them
    assert BANNED.search(") ENGINE=MyISAM") and not BANNED.search(") ENGINE=InnoDB DEFAULT CHARSET=utf8mb4")
    # The one other engine: a Spider head's tables (they hold no rows; every row is on an InnoDB backend),
    # made in one module, and the tool that starts a head asks for it.
    spider = {ROOT / "server" / "store" / "shards.py", *(ROOT / "launchers" / "spider").glob("*.py")}
    for path in [p for d in ("server", "worker", "bench", "launchers") for p in (ROOT / d).rglob("*.py")]:
        banned = LOCKS if path in spider else BANNED
        found = [s for s in _strings(path) if banned.search(s)]
        assert not found, (path, found)
    assert "ENGINE=InnoDB" in MYSQL.ddl["table_options"]


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


def test_every_batched_insert_is_all_placeholders() -> None:
    """aiomysql sends ``executemany`` as one multi-row INSERT only when every value is ``%s``; one literal
    among them and it sends a statement per row (measured: 1,012 statements for a 500-credit batch on a
    sharded ledger instead of 14). Literals go in as parameters."""
    shape = re.compile(r"VALUES \((%s, )*%s\)")
    found = []
    for path in [p for d in ("server", "worker", "bench", "launchers") for p in (ROOT / d).rglob("*.py")]:
        for sql in _many_statements(path):
            if "VALUES" in sql and not shape.search(sql):
                found.append((path.name, sql))
    assert not found, found
    assert shape.search("INSERT INTO t (a, b) VALUES (%s, %s)") and not shape.search("VALUES (%s, 'x')")
