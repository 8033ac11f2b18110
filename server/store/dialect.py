"""Every difference between the SQL of MySQL/MariaDB and of SQLite, in one place.

The ledger's SQL is written once, with ``%s`` placeholders; ``Dialect.sql`` turns them into SQLite's
``?``, and the fields below give what each engine writes differently: shared and exclusive row locks, an
INSERT that skips a duplicate, the DDL tokens of an id column and of a table's options, and how to ask
whether a table exists. No I/O: ``server.store.db`` runs the statements.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Dialect:
    """How one engine writes what the engines write differently (``MYSQL``, ``SQLITE``)."""

    name: str
    # Appended to a SELECT that must hold a shared row lock until commit (SQLite has one writer anyway).
    share_lock: str
    # Appended to a SELECT that must hold an exclusive row lock until commit.
    for_update: str
    # Counts the tables named %s in the current database.
    table_exists: str
    # An INSERT that skips a row whose key is already there.
    insert_ignore: str
    ddl: dict[str, str]

    def sql(self, statement: str) -> str:
        return statement if self.name == "mysql" else statement.replace("%s", "?")

    def skip_duplicate(self, column: str) -> str:
        """Appended to an INSERT of one row: a row whose unique ``column`` is already there is skipped,
        without the warning MySQL's INSERT IGNORE leaves."""
        if self.name == "mysql":
            return f" ON DUPLICATE KEY UPDATE {column} = {column}"
        return f" ON CONFLICT ({column}) DO NOTHING"

    def concat(self, *parts: str) -> str:
        """SQL that joins ``parts`` (expressions) into one string."""
        return f"CONCAT({', '.join(parts)})" if self.name == "mysql" else "(" + " || ".join(parts) + ")"


MYSQL = Dialect(
    name="mysql",
    share_lock=" LOCK IN SHARE MODE",
    for_update=" FOR UPDATE",
    table_exists="SELECT COUNT(*) FROM information_schema.tables"
    " WHERE table_schema = DATABASE() AND table_name = %s",
    insert_ignore="INSERT IGNORE",
    ddl={
        "id": "BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY",
        "table_options": " ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin",
        # Keys compared byte for byte (utf8mb4_bin pads with spaces): an idempotency key, a request id.
        "key": "VARBINARY(512)",
        "request_id": "VARBINARY(256)",
    },
)
SQLITE = Dialect(
    name="sqlite",
    share_lock="",
    for_update="",
    table_exists="SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name = %s",
    insert_ignore="INSERT OR IGNORE",
    ddl={"id": "INTEGER PRIMARY KEY AUTOINCREMENT", "table_options": "", "key": "TEXT", "request_id": "TEXT"},
)
