"""Values written into MySQL statements by us (``server.store.mysqltx``) are the driver's literals: the
same string as aiomysql's ``mogrify`` for every kind of value, and rows written by a bound multi-row
INSERT read back exactly as the driver's own ``executemany`` writes them — on a real MariaDB."""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator

import pytest

from server.store import mysqltx
from server.store.db import Database, IntegrityError
from server.store.engines import connect


class Kind(enum.StrEnum):
    A = "a'b"


VALUES: list[object] = [
    0,
    -7,
    2**63 - 1,
    -(2**63),
    True,
    False,
    None,
    "",
    "plain",
    "it's",
    'say "hi"',
    "back\\slash",
    "100%",
    "%s",
    "%%",
    "line\nbreak\x00nul\x1a",
    "红包 🧧",
    1.5,
    Kind.A,
]


@pytest.fixture
async def db(mysql_url: str) -> AsyncIterator[Database]:
    d = await connect(mysql_url)
    async with d.transaction() as tx:
        await tx.execute(
            "CREATE OR REPLACE TABLE literal_check (id BIGINT NOT NULL PRIMARY KEY, n BIGINT NULL,"
            " t TEXT NULL, b VARBINARY(64) NULL)"
        )
    try:
        yield d
    finally:
        async with d.transaction() as tx:
            await tx.execute("DROP TABLE literal_check")
        await d.close()


async def test_every_value_is_bound_as_the_driver_mogrifies_it(db: Database) -> None:
    async with db.transaction() as tx:
        cur = tx._cur  # (the transaction's own cursor: its connection's escaping, its mogrify)
        for v in VALUES:
            assert mysqltx.bind(cur.connection, "SELECT %s", (v,)) == cur.mogrify("SELECT %s", (v,)), v
        assert mysqltx.bind(cur.connection, "SELECT '100%%', %s", (1,)) == "SELECT '100%', 1"
        row = "(" + ",".join(["%s"] * len(VALUES)) + ")"
        assert mysqltx.insert_statements(cur.connection, f"INSERT INTO t VALUES {row}", [VALUES]) == [
            "INSERT INTO t VALUES " + cur.mogrify(row, VALUES)
        ]


async def test_strings_follow_the_sessions_quoting_mode(db: Database) -> None:
    """With NO_BACKSLASH_ESCAPES a backslash is a plain character and only quotes are doubled: the
    connection knows the mode from the server's answer, and a bound INSERT follows it."""
    texts = ["back\\slash", "it's", "\\'"]
    async with db.transaction() as tx:
        await tx.execute("SET SESSION sql_mode = CONCAT(@@sql_mode, ',NO_BACKSLASH_ESCAPES')")
        try:
            assert "\\\\" not in mysqltx.bind(tx._cur.connection, "SELECT %s", (texts[0],))
            await tx.executemany("INSERT INTO literal_check (id, t) VALUES (%s, %s)", list(enumerate(texts)))
            back = [r[0] for r in await tx.fetchall("SELECT t FROM literal_check ORDER BY id")]
        finally:
            await tx.execute("SET SESSION sql_mode = REPLACE(@@sql_mode, 'NO_BACKSLASH_ESCAPES', '')")
    assert back == texts


async def test_bound_statements_read_back_what_was_written(db: Database) -> None:
    texts = [v for v in VALUES if isinstance(v, str)]
    async with db.transaction() as tx:
        for i, t in enumerate(texts):
            await tx.execute("INSERT INTO literal_check (id, t) VALUES (%s, %s)", (i, t))
        back = await tx.fetchall(
            f"SELECT t FROM literal_check WHERE t IN ({', '.join(['%s'] * len(texts))}) ORDER BY id", texts
        )
    assert [r[0] for r in back] == texts


async def test_a_bound_multi_row_insert_writes_what_the_drivers_executemany_writes(db: Database) -> None:
    rows = [
        (i, [-1, 2**63 - 1, None][i % 3], [None, "it's", "100%", "红包", "%s"][i % 5], None)
        for i in range(30)
    ]
    sql = "INSERT INTO literal_check (id, n, t, b) VALUES (%s, %s, %s, %s)"
    async with db.transaction() as tx:
        assert await tx.executemany(sql, rows) == 30
        ours = await tx.fetchall("SELECT id, n, t, b FROM literal_check ORDER BY id")
        await tx.execute("DELETE FROM literal_check")
        await tx._cur.executemany(sql, rows)  # the driver's own
        theirs = await tx.fetchall("SELECT id, n, t, b FROM literal_check ORDER BY id")
    assert ours == theirs and len(ours) == 30
    assert ours[1][2] == "it's" and ours[2][2] == "100%" and ours[4][2] == "%s"


async def test_a_long_insert_is_sent_in_pieces_and_every_row_lands(
    db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mysqltx, "MAX_STATEMENT", 300)
    rows = [(i, i * 10, "x" * 20, None) for i in range(100)]
    async with db.transaction() as tx:
        pieces = mysqltx.insert_statements(
            tx._cur.connection, "INSERT INTO literal_check (id, n, t, b) VALUES (%s, %s, %s, %s)", rows
        )
        assert pieces is not None and len(pieces) > 10 and all(len(p) <= 300 for p in pieces)
        assert (
            await tx.executemany("INSERT INTO literal_check (id, n, t, b) VALUES (%s, %s, %s, %s)", rows)
            == 100
        )
        back = await tx.fetchone("SELECT COUNT(*), SUM(n) FROM literal_check")
    assert back == (100, sum(i * 10 for i in range(100)))


async def test_on_duplicate_and_unique_keys_behave_as_with_the_driver(db: Database) -> None:
    async with db.transaction() as tx:
        await tx.executemany("INSERT INTO literal_check (id, n) VALUES (%s, %s)", [(1, 1), (2, 2)])
        await tx.executemany(
            "INSERT INTO literal_check (id, n) VALUES (%s, %s) ON DUPLICATE KEY UPDATE n = n + 10",
            [(1, 0), (3, 3)],
        )
        assert await tx.fetchall("SELECT id, n FROM literal_check ORDER BY id") == [(1, 11), (2, 2), (3, 3)]
    with pytest.raises(IntegrityError):
        async with db.transaction() as tx:
            await tx.executemany("INSERT INTO literal_check (id, n) VALUES (%s, %s)", [(4, 4), (2, 2)])
    assert await db.fetchone("SELECT COUNT(*) FROM literal_check WHERE id = 4") == (0,)


def test_a_row_of_the_wrong_width_is_refused() -> None:
    with pytest.raises(ValueError, match="a row of 1 values for an INSERT of 2 columns"):
        mysqltx.insert_statements(None, "INSERT INTO t (a, b) VALUES (%s, %s)", [(1,)])
    assert mysqltx.insert_statements(None, "UPDATE t SET a = %s", [(1,)]) is None
