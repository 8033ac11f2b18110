"""The schema is one Galera can replicate, and ``redpacket migrate`` refuses one it cannot: every table
InnoDB with a primary key; migrations take turns through a lease row (never ``GET_LOCK`` or ``LOCK
TABLES``, which Galera refuses: the source is read for them in ``tests/unit/test_schema_fit.py``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from server.store import schema
from server.store.db import Database, DatabaseError
from server.store.engines import connect
from tests.conftest import fresh_database


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
