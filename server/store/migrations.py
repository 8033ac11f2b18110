"""The schema's versions: each migration a list of statements with ``{id}``, ``{key}``, ``{request_id}``
and ``{table_options}`` tokens that the dialect fills in; a statement only one dialect needs is a
``{dialect name: statement}`` map. ``server.store.schema`` applies them. Never edit a released migration:
add the next one.

All times are unix milliseconds in BIGINT columns, all money is integer cents in BIGINT columns.
"""

from __future__ import annotations

import secrets

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

MIGRATIONS.append(
    (
        10,
        "the shard an event is written on, the head's claim of a request key",
        [
            # The id its transaction's shard is chosen by (server.store.shards): the user's for a balance
            # change, the packet's for ``packet.finished`` (written where the packet's last share is
            # marked paid). Only a sharded ledger places rows by it.
            "ALTER TABLE events ADD COLUMN shard_id BIGINT NULL",
            "UPDATE events SET shard_id = user_id",
            # A sharded ledger's keys that name one user's request whoever asks (a service top-up, a
            # withdrawal, a hold): claimed here, on the head, before the user's shard posts (a journal
            # key is unique within a shard only). Unused on one database, where the journal's key is.
            """CREATE TABLE request_claims (
                idem_key {key} NOT NULL PRIMARY KEY,
                user_id BIGINT NOT NULL,
                created_ms BIGINT NOT NULL
            ){table_options}""",
        ],
    )
)

MIGRATIONS.append(
    (
        11,
        "the seed a packet's shares were drawn from",
        [
            # 64 hex characters (redpacket_client.fairness), shown once the packet is finished or refunded;
            # NULL for a packet sent before packets were provably fair.
            # MariaDB commits an ALTER on its own: IF NOT EXISTS lets a migration stopped after it (before
            # its version was recorded) run again. SQLite's ALTER is in the migration's transaction.
            {
                "mysql": "ALTER TABLE red_packets ADD COLUMN IF NOT EXISTS seed CHAR(64) NULL",
                "sqlite": "ALTER TABLE red_packets ADD COLUMN seed CHAR(64) NULL",
            },
        ],
    )
)

MIGRATIONS.append(
    (
        12,
        "a person's packets sent and received, paged by packet id (GET /api/me/packets/sent, /received)",
        [
            # (IF NOT EXISTS: MariaDB commits each on its own, so a migration stopped half-way runs again.)
            "CREATE INDEX IF NOT EXISTS red_packets_sender ON red_packets (sender_id, id)",
            "CREATE INDEX IF NOT EXISTS grab_records_user_packet ON grab_records (user_id, packet_id)",
        ],
    )
)

MIGRATIONS.append(
    (
        13,
        "a credit batch's events in one row, read back from its journal rows",
        [
            # A row of ``n`` events takes seqs seq - n + 1 … seq; a credit batch's row (``tx``: the token
            # its grab journal rows carry) is read back one event per row (server.money.events).
            # (IF NOT EXISTS: MariaDB commits each on its own, so a migration stopped half-way runs again.)
            {
                "mysql": "ALTER TABLE events ADD COLUMN IF NOT EXISTS n INT NOT NULL DEFAULT 1",
                "sqlite": "ALTER TABLE events ADD COLUMN n INT NOT NULL DEFAULT 1",
            },
            {
                "mysql": "ALTER TABLE events ADD COLUMN IF NOT EXISTS tx BIGINT NULL",
                "sqlite": "ALTER TABLE events ADD COLUMN tx BIGINT NULL",
            },
            "CREATE INDEX IF NOT EXISTS journal_tx ON journal (tx)",
            # A delivery names its event's type (a delivery of a credit has no event row of its own seq).
            {
                "mysql": "ALTER TABLE webhook_deliveries ADD COLUMN IF NOT EXISTS type VARCHAR(24) NULL",
                "sqlite": "ALTER TABLE webhook_deliveries ADD COLUMN type VARCHAR(24) NULL",
            },
            "UPDATE webhook_deliveries SET type = (SELECT e.type FROM events e"
            " WHERE e.seq = webhook_deliveries.seq) WHERE type IS NULL",
        ],
    )
)

MIGRATIONS.append(
    (
        14,
        "how many of a packet's shares are paid, kept on its row",
        [
            # Raised in the transaction that marks its grab records credited (server.money.ledger
            # .finish_paid), so the last share's credit sees the packet full without counting its records.
            # NULL on a packet sent before: counted from its records until it settles (within a day).
            # (IF NOT EXISTS: MariaDB commits an ALTER on its own, so a migration stopped half-way runs
            # again.)
            {
                "mysql": "ALTER TABLE red_packets ADD COLUMN IF NOT EXISTS credited_count INT NULL",
                "sqlite": "ALTER TABLE red_packets ADD COLUMN credited_count INT NULL",
            },
        ],
    )
)

LATEST = MIGRATIONS[-1][0]
