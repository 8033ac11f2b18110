"""The one schema definition, applied by versioned migrations.

Each migration is a list of statements with ``{id}`` and ``{table_options}`` tokens that the dialect
fills in; a statement only one dialect needs is a ``{dialect name: statement}`` map. ``migrate()``
applies the ones a database has not seen, in order, and records each in ``schema_migrations``; running
it again is a no-op. Never edit a released migration: add the next one.

All times are unix milliseconds in BIGINT columns, all money is integer cents in BIGINT columns.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from server.store.db import Database, DatabaseError, IntegrityError, Tx, as_text

log = logging.getLogger(__name__)

Statement = str | dict[str, str]

MIGRATIONS: list[tuple[int, str, list[Statement]]] = [
    (
        1,
        "ledger, groups and packets",
        [
            """CREATE TABLE users (
                id {id},
                name VARCHAR(64) NOT NULL,
                created_ms BIGINT NOT NULL,
                UNIQUE (name)
            ){table_options}""",
            # One account per user. The balance is a cache of the journal that must always equal its sum.
            """CREATE TABLE accounts (
                user_id BIGINT NOT NULL PRIMARY KEY,
                balance BIGINT NOT NULL,
                updated_ms BIGINT NOT NULL,
                CHECK (balance >= 0)
            ){table_options}""",
            # Append-only: every balance change is one row, keyed by what caused it.
            """CREATE TABLE journal (
                id {id},
                account_id BIGINT NOT NULL,
                amount BIGINT NOT NULL,
                kind VARCHAR(16) NOT NULL,
                idem_key VARCHAR(128) NOT NULL,
                packet_id BIGINT NULL,
                created_ms BIGINT NOT NULL,
                UNIQUE (idem_key)
            ){table_options}""",
            "CREATE INDEX journal_account ON journal (account_id)",
            "CREATE INDEX journal_packet ON journal (packet_id)",
            """CREATE TABLE chat_groups (
                id {id},
                name VARCHAR(64) NOT NULL,
                owner_id BIGINT NOT NULL,
                members_can_send SMALLINT NOT NULL DEFAULT 0,
                created_ms BIGINT NOT NULL
            ){table_options}""",
            """CREATE TABLE group_members (
                group_id BIGINT NOT NULL,
                user_id BIGINT NOT NULL,
                role VARCHAR(8) NOT NULL,
                joined_ms BIGINT NOT NULL,
                PRIMARY KEY (group_id, user_id)
            ){table_options}""",
            "CREATE INDEX group_members_user ON group_members (user_id)",
            """CREATE TABLE red_packets (
                id {id},
                sender_id BIGINT NOT NULL,
                group_id BIGINT NOT NULL,
                kind VARCHAR(16) NOT NULL,
                total BIGINT NOT NULL,
                share_count INT NOT NULL,
                greeting VARCHAR(255) NOT NULL,
                target_user_id BIGINT NULL,
                status VARCHAR(16) NOT NULL,
                request_id VARCHAR(64) NULL,
                created_ms BIGINT NOT NULL,
                expires_ms BIGINT NOT NULL,
                finished_ms BIGINT NULL,
                UNIQUE (sender_id, request_id),
                CHECK (total > 0 AND share_count > 0 AND share_count <= total)
            ){table_options}""",
            "CREATE INDEX red_packets_status ON red_packets (status, expires_ms)",
            "CREATE INDEX red_packets_group ON red_packets (group_id, created_ms)",
            # Written in the same transaction as the sender's debit: the shares exist before anyone grabs.
            """CREATE TABLE red_packet_shares (
                packet_id BIGINT NOT NULL,
                seq INT NOT NULL,
                amount BIGINT NOT NULL,
                PRIMARY KEY (packet_id, seq),
                CHECK (amount > 0)
            ){table_options}""",
            # The database itself refuses to pay one share twice or one user twice, whatever Redis says.
            """CREATE TABLE grab_records (
                id {id},
                packet_id BIGINT NOT NULL,
                user_id BIGINT NOT NULL,
                seq INT NOT NULL,
                amount BIGINT NOT NULL,
                status VARCHAR(16) NOT NULL,
                grabbed_ms BIGINT NOT NULL,
                credited_ms BIGINT NULL,
                UNIQUE (packet_id, user_id),
                UNIQUE (packet_id, seq)
            ){table_options}""",
            "CREATE INDEX grab_records_user ON grab_records (user_id, grabbed_ms)",
        ],
    ),
    (
        2,
        "when a packet was announced to its group",
        [
            # NULL until the packet's event is published; hubs and a worker announce what is left NULL.
            "ALTER TABLE red_packets ADD COLUMN announced_ms BIGINT NULL",
            "UPDATE red_packets SET announced_ms = created_ms",
            "CREATE INDEX red_packets_unannounced ON red_packets (announced_ms, created_ms)",
        ],
    ),
    (
        3,
        "the chat backend's version of a group's membership",
        [
            # Set by PUT /api/service/groups/{g}: a replacement with a lower version is ignored.
            "ALTER TABLE chat_groups ADD COLUMN service_version BIGINT NULL",
        ],
    ),
    (
        4,
        "keys compared byte for byte, refused credits, the transaction of each journal row",
        [
            # utf8mb4_bin pads with spaces: "r1" and "r1 " were one key to the unique indexes. Bytes
            # compare as SQLite's text does (4 bytes a character: the keys' lengths are in characters).
            {
                "mysql": "ALTER TABLE journal MODIFY idem_key VARBINARY(512) NOT NULL",
            },
            {
                "mysql": "ALTER TABLE red_packets MODIFY request_id VARBINARY(256) NULL",
            },
            # Which Database.run call posted the row (``Tx.token``): a run again after a lost COMMIT
            # answer tells its own rows from another caller's, and reconciliation sees one call that
            # posted twice.
            "ALTER TABLE journal ADD COLUMN tx BIGINT NULL",
            # A grab Redis answered that the ledger will never pay (the credit refused, or dropped by a
            # repair because the database holds that share for someone else): kept for the audit, which
            # reports every one not paid since.
            """CREATE TABLE credit_refusals (
                packet_id BIGINT NOT NULL,
                user_id BIGINT NOT NULL,
                seq INT NOT NULL,
                amount BIGINT NOT NULL,
                grabbed_ms BIGINT NOT NULL,
                code VARCHAR(32) NOT NULL,
                refused_by VARCHAR(16) NOT NULL,
                refused_ms BIGINT NOT NULL,
                PRIMARY KEY (packet_id, user_id, seq)
            ){table_options}""",
        ],
    ),
    (
        5,
        "who made each user: the hub (dev login) or the chat backend",
        [
            # 'backend': made by PUT /api/service/users/{id}; dev login never issues its token, and the
            # backend never takes over a user the hub made ('hub'). '' for the users of a database from
            # before: nobody knows who made them, so neither side is refused them (a backend's put then
            # marks the user its own). Every insert names its origin. A group's maker is its
            # service_version (NULL: made on the hub by a user).
            "ALTER TABLE users ADD COLUMN origin VARCHAR(8) NOT NULL DEFAULT ''",
        ],
    ),
    (
        6,
        "the groups a user made lately, counted at each new one",
        ["CREATE INDEX chat_groups_owner ON chat_groups (owner_id, created_ms)"],
    ),
    (
        7,
        "this deployment's name in a Redis it may share (server.store.keys)",
        [
            "CREATE TABLE deployment (id VARCHAR(32) NOT NULL PRIMARY KEY){table_options}",
            # Random for a new database; empty for one that already has users or groups: its keys in
            # Redis (credits not yet paid among them) keep the names they were written under. The id is
            # a literal made here, not UUID() or RAND(): a replica replaying the statement gets the same.
            "INSERT INTO deployment (id) SELECT CASE WHEN EXISTS(SELECT 1 FROM users)"
            " OR EXISTS(SELECT 1 FROM chat_groups) THEN '' ELSE '" + secrets.token_hex(6) + "' END",
        ],
    ),
]

MIGRATIONS.append(
    (
        8,
        "the database node this deployment's processes write through",
        [
            # One row, written by a process that moved to another Galera node (or was told to go back);
            # a process starting reads it, so it joins the others on that node rather than the first
            # node of its URL (server.store.mysql). Unused on one server and on SQLite.
            """CREATE TABLE db_writer (
                id SMALLINT NOT NULL PRIMARY KEY,
                address VARCHAR(255) NOT NULL,
                set_ms BIGINT NOT NULL
            ){table_options}""",
        ],
    )
)

MIGRATIONS.append(
    (
        9,
        "money out (holds) and the event outbox (webhooks, the events API)",
        [
            # A two-phase withdrawal: the money leaves the balance when held (a journal row keyed
            # hold:<request id>), and comes back (release:<request id>) if released or expired.
            """CREATE TABLE holds (
                request_id {request_id} NOT NULL PRIMARY KEY,
                user_id BIGINT NOT NULL,
                amount BIGINT NOT NULL,
                state VARCHAR(12) NOT NULL,
                created_ms BIGINT NOT NULL,
                expires_ms BIGINT NOT NULL,
                closed_ms BIGINT NULL,
                closed_tx BIGINT NULL
            ){table_options}""",
            "CREATE INDEX holds_due ON holds (state, expires_ms)",
            # Written in the transaction of the change it reports; ``seq``, the event's public id, is
            # given after commit, in commit order (server.money.events.sequence), so a reader paging by
            # it never skips an event that committed late. A money event's key is its journal row's.
            """CREATE TABLE events (
                id {id},
                seq BIGINT NULL,
                type VARCHAR(24) NOT NULL,
                idem_key {key} NOT NULL,
                user_id BIGINT NOT NULL,
                amount BIGINT NULL,
                body TEXT NOT NULL,
                created_ms BIGINT NOT NULL,
                UNIQUE (idem_key),
                UNIQUE (seq)
            ){table_options}""",
            # The last seq given; journal rows up to journal_from came before events were written.
            """CREATE TABLE event_counter (
                name VARCHAR(16) NOT NULL PRIMARY KEY,
                last_seq BIGINT NOT NULL,
                journal_from BIGINT NOT NULL
            ){table_options}""",
            "INSERT INTO event_counter (name, last_seq, journal_from)"
            " SELECT 'events', 0, COALESCE(MAX(id), 0) FROM journal",
            # Per webhook URL (a hash of it): the last event queued for it, and each event's delivery.
            """CREATE TABLE webhook_cursors (
                endpoint VARCHAR(32) NOT NULL PRIMARY KEY,
                after_seq BIGINT NOT NULL
            ){table_options}""",
            """CREATE TABLE webhook_deliveries (
                endpoint VARCHAR(32) NOT NULL,
                seq BIGINT NOT NULL,
                user_id BIGINT NOT NULL,
                state VARCHAR(12) NOT NULL,
                attempts INT NOT NULL,
                next_ms BIGINT NOT NULL,
                lease_ms BIGINT NOT NULL,
                lease_token BIGINT NOT NULL,
                first_ms BIGINT NOT NULL,
                done_ms BIGINT NULL,
                last_error VARCHAR(200) NULL,
                PRIMARY KEY (endpoint, seq)
            ){table_options}""",
            "CREATE INDEX webhook_due ON webhook_deliveries (endpoint, state, next_ms)",
            "CREATE INDEX webhook_user ON webhook_deliveries (endpoint, user_id, state, seq)",
        ],
    )
)

LATEST = MIGRATIONS[-1][0]


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
# of such a table are applied by full scans, and its rows can differ between nodes).
UNFIT_FOR_GALERA = """SELECT t.table_name, t.engine,
    EXISTS(SELECT 1 FROM information_schema.table_constraints c WHERE c.table_schema = t.table_schema
           AND c.table_name = t.table_name AND c.constraint_type = 'PRIMARY KEY')
    FROM information_schema.tables t
    WHERE t.table_schema = DATABASE() AND t.table_type = 'BASE TABLE' AND (t.engine <> 'InnoDB'
      OR NOT EXISTS(SELECT 1 FROM information_schema.table_constraints c WHERE c.table_schema = t.table_schema
                    AND c.table_name = t.table_name AND c.constraint_type = 'PRIMARY KEY'))
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
        why = [] if str(engine) == "InnoDB" else [f"engine {engine}, not InnoDB"]
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


async def migrate(db: Database) -> list[int]:
    """Apply every migration the database lacks; return the versions applied now. On MySQL, refuse a
    database with tables Galera cannot replicate, before and after (``unfit_for_galera``)."""
    applied_now: list[int] = []
    await _refuse_unfit(db)
    async with db.transaction() as tx:
        if {v for v, _, _ in MIGRATIONS} <= await _applied(tx, make=False):
            return applied_now  # every process starts with this: no lease taken when nothing is due
    async with migration_lease(db) as holder, db.transaction() as tx:
        done = await _applied(tx)
        for version, name, statements in MIGRATIONS:
            if version in done:
                continue
            for statement in statements:
                sql = statement.get(db.dialect.name) if isinstance(statement, dict) else statement
                if sql is not None:
                    await renew_lease(tx, holder)
                    await tx.execute(sql.format(**db.dialect.ddl))
            await tx.execute(
                "INSERT INTO schema_migrations (version, name, applied_ms) VALUES (%s, %s, %s)",
                (version, name, now_ms()),
            )
            log.info("applied migration %d: %s", version, name)
            applied_now.append(version)
    await _refuse_unfit(db)
    return applied_now
