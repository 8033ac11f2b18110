"""A transaction on MySQL/MariaDB (``TimedTx``): every statement bounded in time, and its values written
into the statement here rather than by the driver.

The literals are the driver's own: ``bind`` gives exactly what aiomysql's ``Cursor.mogrify`` gives (its
``Connection.escape`` for every value), except that an int is written as its digits directly. A credit
batch of 500 sends some 9,500 values, nearly all ints, and the driver passes each through three calls
and a type lookup: 1.4 s of a 3.0 s cProfile run of 20,000 credits, which was also writing a row of
events a credit (``docs/benchmarks.md``, issue 44). A statement bound here goes to the driver with no
arguments, so it is not formatted a second time. (A string goes through the connection's
``escape_string``, which follows the session's quoting mode.)
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Sequence
from typing import Any, TypeVar

from server.store.db import Params, Tx
from server.store.dialect import MYSQL
from server.store.mysqlkit import bounded

T = TypeVar("T")

# A multi-row INSERT's parts, as aiomysql's ``executemany`` finds them: the head, one row of ``%s``
# and what follows (``ON DUPLICATE KEY UPDATE …``). Another statement goes to the driver's executemany.
_INSERT = re.compile(
    r"(\s*(?:INSERT|REPLACE)\s.+\sVALUES?\s+)(\(\s*%s\s*(?:,\s*%s\s*)*\))(\s*(?:ON DUPLICATE.*)?);?\s*\Z",
    re.IGNORECASE | re.DOTALL,
)
# The longest statement one ``executemany`` sends (aiomysql's own limit); more rows go in the next.
MAX_STATEMENT = 1_024_000


def literal(conn: Any, value: object) -> str:
    """``value`` as SQL, as the driver writes it (an int: its digits; a bool is not an int here)."""
    return str(value) if type(value) is int else str(conn.escape(value))


def _row(conn: Any, row: Params, quoted: dict[str, str]) -> str:
    """One row of values, ``(…)``: ``literal`` of each, a ``str`` quoted by the connection's own
    ``escape_string`` as its ``escape`` does (a third of a row's time, inlined), once an INSERT:
    ``quoted`` keeps what its rows quoted so far (a credit batch's status and journal kind are the same
    string in every row, and quoting one cost 0.5 µs)."""
    parts: list[str] = []
    for v in row:
        t = type(v)
        if t is int:
            parts.append(str(v))
        elif t is str:
            q = quoted.get(v)
            if q is None:
                q = quoted[v] = "'" + conn.escape_string(v) + "'"
            parts.append(q)
        else:
            parts.append(str(conn.escape(v)))
    return "(" + ",".join(parts) + ")"


def bind(conn: Any, statement: str, params: Params) -> str:
    """``statement`` with its ``%s`` replaced by ``params``' literals (``%%`` becomes ``%``), as the driver
    would: ``Cursor.mogrify``'s result."""
    return statement % tuple([literal(conn, v) for v in params])


def insert_statements(conn: Any, statement: str, rows: Sequence[Params]) -> list[str] | None:
    """The multi-row INSERTs that write ``rows`` (each at most ``MAX_STATEMENT`` long), or None when
    ``statement`` is not one INSERT of a row of ``%s``."""
    m = _INSERT.match(statement)
    if m is None:
        return None
    head, row, tail = m.group(1), m.group(2), m.group(3)
    width = row.count("%s")
    out: list[str] = []
    values: list[str] = []
    size = len(head) + len(tail)
    quoted: dict[str, str] = {}
    for r in rows:
        if len(r) != width:
            raise ValueError(f"a row of {len(r)} values for an INSERT of {width} columns")
        v = _row(conn, r, quoted)
        if values and size + len(v) + 1 > MAX_STATEMENT:
            out.append(head + ",".join(values) + tail)
            values, size = [], len(head) + len(tail)
        values.append(v)
        size += len(v) + 1
    out.append(head + ",".join(values) + tail)
    return out


class TimedTx(Tx):
    """A transaction whose every statement is bounded in time, its values bound here."""

    def __init__(self, cursor: Any, timeout: float) -> None:
        super().__init__(MYSQL, cursor)
        self._timeout = timeout

    async def _run(self, step: Awaitable[T]) -> T:
        return await bounded(step, self._timeout)

    async def _send(self, statement: str, params: Params) -> None:
        await self._run(self._cur.execute(bind(self._cur.connection, statement, params)))

    async def _send_many(self, statement: str, rows: Sequence[Params]) -> int:
        statements = insert_statements(self._cur.connection, statement, rows)
        if statements is None:
            return await super()._send_many(statement, rows)
        changed = 0
        for sql in statements:
            await self._run(self._cur.execute(sql))
            changed += int(self._cur.rowcount)
        return changed
