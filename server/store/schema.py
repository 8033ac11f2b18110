"""Applying the schema's versioned migrations (``server.store.migrations``): ``migrate()`` applies the
ones a database has not seen, in order, and records each in ``schema_migrations``; running it again is a
no-op. One ``migrate`` at a time (``migration_lease``); tables Galera cannot replicate are refused.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from server.store.db import Database, DatabaseError, IntegrityError, Tx, as_text
from server.store.dialect import Dialect
from server.store.migrations import LATEST as LATEST
from server.store.migrations import MIGRATIONS as MIGRATIONS

log = logging.getLogger(__name__)


def now_ms() -> int:
    return int(time.time() * 1000)


async def _applied(tx: Tx, make: bool = True) -> set[int]:
    """The versions applied; ``make``: make the table first when there is none (else: none applied)."""
    exists = await tx.fetchone(tx.dialect.table_exists, ("schema_migrations",))
    if not exists or not exists[0]:
        if not make:
            return set()
        await tx.execute(
            "CREATE TABLE schema_migrations ("
            " version INT NOT NULL PRIMARY KEY, name VARCHAR(128) NOT NULL, applied_ms BIGINT NOT NULL)"
            + tx.dialect.ddl["table_options"]
        )
    return {int(r[0]) for r in await tx.fetchall("SELECT version FROM schema_migrations")}


async def deployment_id(db: Database) -> str:
    """The id migration 7 gave this database: every process of the deployment names its Redis keys and
    queue with it. A database not yet migrated so has none to give: run ``redpacket migrate``."""
    try:
        row = await db.fetchone("SELECT id FROM deployment")
    except DatabaseError as e:
        raise DatabaseError(f"the database has no deployment id (run `redpacket migrate`): {e}") from e
    if row is None:
        raise DatabaseError("the database has no deployment id (run `redpacket migrate`)")
    return as_text(row[0])


# Tables Galera cannot replicate (or replicates wrongly): not InnoDB, or without a primary key (row events
# of such a table are applied by full scans, and its rows can differ between nodes). A Spider head's
# sharded tables hold no rows of their own (server.store.shards).
UNFIT_FOR_GALERA = """SELECT t.table_name, t.engine,
    EXISTS(SELECT 1 FROM information_schema.table_constraints c WHERE c.table_schema = t.table_schema
           AND c.table_name = t.table_name AND c.constraint_type = 'PRIMARY KEY')
    FROM information_schema.tables t
    WHERE t.table_schema = DATABASE() AND t.table_type = 'BASE TABLE'
      AND (t.engine NOT IN ('InnoDB', 'SPIDER')
           OR NOT EXISTS(SELECT 1 FROM information_schema.table_constraints c
                         WHERE c.table_schema = t.table_schema AND c.table_name = t.table_name
                         AND c.constraint_type = 'PRIMARY KEY'))
    ORDER BY t.table_name"""

# How long after its holder last renewed it (before each statement) another ``migrate`` may take the
# migration lease over (a process killed mid-migration never releases it; one statement on a big table may
# run for minutes), and how often a waiting one looks again.
LEASE_MS = 600_000
LEASE_POLL_S = 0.2


async def unfit_for_galera(db: Database) -> list[str]:
    """Every table of the database that a Galera cluster cannot replicate, each with why; [] on SQLite."""
    if db.dialect.name != "mysql":
        return []
    problems = []
    for name, engine, has_key in await db.fetchall(UNFIT_FOR_GALERA):
        why = [] if str(engine) in ("InnoDB", "SPIDER") else [f"engine {engine}, not InnoDB"]
        why += [] if has_key else ["no primary key"]
        problems.append(f"{as_text(name)}: {' and '.join(why)}")
    return problems


async def _refuse_unfit(db: Database) -> None:
    problems = await unfit_for_galera(db)
    if problems:
        raise DatabaseError(
            "the database has tables Galera cannot replicate (every table must be InnoDB with a primary"
            " key): " + "; ".join(problems)
        )


@asynccontextmanager
async def migration_lease(db: Database) -> AsyncIterator[str]:
    """One ``migrate`` at a time over every process and every node: a row in ``schema_lease``, inserted
    (a unique key refuses a second) and deleted when done; one older than ``LEASE_MS`` is taken over.
    Not ``GET_LOCK``: a named lock lives on one server, and Galera refuses it."""
    if db.dialect.name != "mysql":  # SQLite: one writer at a time anyway
        yield ""
        return
    exists = await db.fetchone(db.dialect.table_exists, ("schema_lease",))
    if not exists or not exists[0]:
        try:
            await db.fetchall(
                "CREATE TABLE schema_lease (name VARCHAR(16) NOT NULL PRIMARY KEY,"
                " holder VARCHAR(32) NOT NULL, taken_ms BIGINT NOT NULL)" + db.dialect.ddl["table_options"]
            )
        except DatabaseError:  # another process made it meanwhile
            pass
    me = secrets.token_hex(8)
    deadline = time.monotonic() + LEASE_MS / 1000
    while True:

        async def take(tx: Tx) -> int:
            stale = now_ms() - LEASE_MS
            await tx.execute("DELETE FROM schema_lease WHERE name = 'migrate' AND taken_ms < %s", (stale,))
            return await tx.execute(
                "INSERT INTO schema_lease (name, holder, taken_ms) VALUES ('migrate', %s, %s)", (me, now_ms())
            )

        try:
            taken = await db.run(take, idempotent=True)
        except IntegrityError:
            taken = 0  # another holds it
        if taken or await db.fetchone(
            "SELECT 1 FROM schema_lease WHERE name = 'migrate' AND holder = %s", (me,)
        ):
            break
        if time.monotonic() > deadline:
            raise DatabaseError("another `redpacket migrate` holds the migration lease: try again later")
        await asyncio.sleep(LEASE_POLL_S)  # another process migrates: its lease ends when it is done
    try:
        yield me
    finally:
        await db.fetchall("DELETE FROM schema_lease WHERE name = 'migrate' AND holder = %s", (me,))


async def renew_lease(tx: Tx, holder: str) -> None:
    """Keep the lease while migrating: on the migration's own connection, before each statement (a
    process given one connection has no other to renew it on)."""
    if tx.dialect.name == "mysql":
        await tx.execute(
            "UPDATE schema_lease SET taken_ms = %s WHERE name = 'migrate' AND holder = %s", (now_ms(), holder)
        )


class SchemaBehind(DatabaseError):
    """A database opened without migrating that lacks migrations this code knows (``missing``)."""

    def __init__(self, missing: list[int]) -> None:
        super().__init__(f"the database lacks migrations {missing}: run `redpacket migrate` first")
        self.missing = missing


async def pending(db: Database) -> list[int]:
    """The versions a database has not applied yet."""
    async with db.transaction() as tx:
        done = await _applied(tx, make=False)
    return [v for v, _, _ in MIGRATIONS if v not in done]


def statements(dialect: Dialect, version: int) -> list[str]:
    """Migration ``version``'s statements as ``migrate`` runs them on ``dialect``: its own, tokens filled."""
    out = []
    for v, _, listed in MIGRATIONS:
        for statement in listed if v == version else []:
            sql = statement.get(dialect.name) if isinstance(statement, dict) else statement
            if sql is not None:
                out.append(sql.format(**dialect.ddl))
    return out


@asynccontextmanager
async def _lease(db: Database, held: str | None) -> AsyncIterator[str]:
    if held is not None:
        yield held
        return
    async with migration_lease(db) as holder:
        yield holder


def _refuse_newer(applied: set[int], known: set[int]) -> None:
    """A program older than the schema reads rows it does not know as rows it does (it would number a
    credit batch's one event row as one event): it does not start."""
    if applied - known:
        raise DatabaseError(
            f"the database has migration(s) {sorted(applied - known)}, newer than this program (schema"
            f" version {max(known)}): run the newer program here, or stop this one"
        )


async def migrate(
    db: Database, *, runs_here: Callable[[str], bool] | None = None, lease: str | None = None
) -> list[int]:
    """Apply every migration the database lacks; return the versions applied now. On MySQL, refuse a
    database with tables Galera cannot replicate, before and after (``unfit_for_galera``).

    ``runs_here``: on a Spider head, which statements run there; the others ran on the backends and are
    recorded with their migration only (``server.store.shards``). A head without it is refused.
    ``lease``: the migration lease, when the caller holds it already (``migration_lease``)."""
    applied_now: list[int] = []
    await _refuse_unfit(db)
    async with db.transaction() as tx:
        applied = await _applied(tx, make=False)
    known = {v for v, _, _ in MIGRATIONS}
    _refuse_newer(applied, known)
    if known <= applied:
        return applied_now  # every process starts with this: no lease taken when nothing is due
    if db.shards and runs_here is None:
        # A Spider head's sharded tables are definitions of the backends' tables: an ALTER here changes
        # neither the backends nor safely the head (server.store.shards.make_sharded does it).
        raise DatabaseError(
            "a sharded ledger's migrations are applied by `redpacket migrate` with REDPACKET_SHARDS set"
            " (the backends first, then the head's definitions of them), not by a process starting"
        )
    async with _lease(db, lease) as holder, db.transaction() as tx:
        done = await _applied(tx)
        _refuse_newer(done, known)  # (a newer program may have migrated while this one waited)
        for version, name, _ in MIGRATIONS:
            if version in done:
                continue
            for sql in statements(db.dialect, version):
                if runs_here is None or runs_here(sql):
                    await renew_lease(tx, holder)
                    await tx.execute(sql)
            await tx.execute(
                "INSERT INTO schema_migrations (version, name, applied_ms) VALUES (%s, %s, %s)",
                (version, name, now_ms()),
            )
            log.info("applied migration %d: %s", version, name)
            applied_now.append(version)
    await _refuse_unfit(db)
    return applied_now
