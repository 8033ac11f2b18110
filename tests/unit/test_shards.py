"""The sharded ledger's statements, read without a server (``server.store.shards``): the head's table made
from a backend's definition, the shard of an id, and the table every migration statement writes (a statement
whose table cannot be told is refused)."""

from __future__ import annotations

import pytest

from server.store import schema, shards
from server.store.db import DatabaseError
from server.store.dialect import MYSQL
from server.store.shards import runs_on_head, shard_of, spider_table, written_table


def test_the_head_widens_each_unique_key_by_the_shard_column_and_keeps_the_rest() -> None:
    create = (
        "CREATE TABLE `journal` (\n  `id` bigint(20) NOT NULL AUTO_INCREMENT,\n"
        "  `account_id` bigint(20) NOT NULL,\n  `idem_key` varbinary(512) NOT NULL,\n"
        "  PRIMARY KEY (`id`),\n  UNIQUE KEY `idem_key` (`idem_key`),\n"
        "  UNIQUE KEY `both` (`account_id`,`idem_key`),\n  KEY `journal_account` (`account_id`)\n"
        ") ENGINE=InnoDB AUTO_INCREMENT=7 DEFAULT CHARSET=utf8mb4"
    )
    got = spider_table(create, "journal", "account_id", ["s0", "s1"])
    assert "PRIMARY KEY (`id`,`account_id`)" in got
    assert "UNIQUE KEY `idem_key` (`idem_key`,`account_id`)" in got
    assert "UNIQUE KEY `both` (`account_id`,`idem_key`)" in got  # already holds it
    assert "KEY `journal_account` (`account_id`)" in got
    assert "AUTO_INCREMENT=7" not in got and "ENGINE=InnoDB" not in got
    parts = "(PARTITION p0 COMMENT = 'srv \"s0\"', PARTITION p1 COMMENT = 'srv \"s1\"')"
    assert got.endswith("PARTITION BY HASH (`account_id`) " + parts)
    assert [shard_of(k, 3) for k in (3, 4, 5)] == [0, 1, 2] and shard_of(5, 0) == 0
    assert shards.by_shard([5, 3, 4, 6], 3) == {0: [3, 6], 1: [4], 2: [5]}


def test_every_migration_statement_has_a_place_on_a_sharded_ledger() -> None:
    placed = {sql: written_table(sql) for v, _, _ in schema.MIGRATIONS for sql in schema.statements(MYSQL, v)}
    assert placed["ALTER TABLE red_packets ADD COLUMN IF NOT EXISTS seed CHAR(64) NULL"] == "red_packets"
    assert placed["UPDATE events SET shard_id = user_id"] == "events"  # a data update: the backends'
    counter = next(sql for sql in placed if sql.startswith("INSERT INTO event_counter"))
    assert runs_on_head(counter)  # the head's own table, read from a sharded one through the head
    assert not runs_on_head("CREATE INDEX red_packets_status ON red_packets (status, expires_ms)")
    assert written_table("DELETE FROM `journal` WHERE id = 1") == "journal"
    assert written_table("DROP INDEX holds_due ON holds") == "holds"
    index = "CREATE INDEX IF NOT EXISTS grab_records_user_packet ON grab_records (user_id, packet_id)"
    assert placed[index] == "grab_records" and not runs_on_head(index)


@pytest.mark.parametrize(
    "sql",
    [
        "UPDATE red_packets JOIN users ON users.id = red_packets.sender_id SET greeting = users.name",
        "UPDATE red_packets, users SET greeting = ''",
        "DROP TABLE users, journal",
        "RENAME TABLE journal TO ledger",
        "ALTER TABLE red_packets RENAME TO packets",
        "CREATE TABLE packets LIKE red_packets",
        "OPTIMIZE TABLE journal",
        "UPDATE users SET name = ''; UPDATE journal SET amount = 0",
        "UPDATE red_packets SET greeting = (SELECT name FROM users WHERE id = sender_id)",
        "INSERT INTO journal (account_id) SELECT user_id FROM accounts",
    ],
)
def test_a_statement_that_cannot_be_placed_is_refused(sql: str) -> None:
    with pytest.raises(DatabaseError, match=r"cannot tell which table|sharded table .* from other tables"):
        written_table(sql)
