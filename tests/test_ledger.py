"""The ledger on both dialects: every change a journal row, idempotent keys, balances never negative."""

from __future__ import annotations

from typing import Any

import pytest

from server import errors
from server.core import Core
from server.errors import Conflict, InvalidRequest, RedPacketError
from server.money import journal, ledger, packets
from server.store.db import Database, Tx
from tests.conftest import make_world


async def _journal_rows(db: Database) -> int:
    row = await db.fetchone("SELECT COUNT(*) FROM journal")
    assert row is not None
    return int(row[0])


async def test_topup_is_idempotent_and_journal_sums_to_balance(core: Core) -> None:
    u = await ledger.create_user(core.db, "li")
    assert await ledger.topup(core.db, u, 500, "r1") is True
    assert await ledger.topup(core.db, u, 500, "r1") is False
    assert await ledger.topup(core.db, u, 250, "r2") is True
    assert await ledger.balance(core.db, u) == 750
    assert await journal.journal_sum(core.db, u) == 750
    assert await _journal_rows(core.db) == 2


async def test_reusing_a_key_for_another_amount_is_refused(core: Core) -> None:
    u = await ledger.create_user(core.db, "li")
    await ledger.topup(core.db, u, 500, "r1")
    with pytest.raises(Conflict) as e:
        await ledger.topup(core.db, u, 501, "r1")
    assert e.value.code == errors.IDEMPOTENCY_KEY_REUSED
    assert await ledger.balance(core.db, u) == 500


@pytest.mark.parametrize("amount", [0, -1, 1.5, "10", None, True, ledger.MAX_TOPUP_CENTS + 1])
async def test_bad_topups_move_nothing(core: Core, amount: object) -> None:
    u = await ledger.create_user(core.db, "li")
    with pytest.raises(InvalidRequest) as e:
        await ledger.topup(core.db, u, amount, "bad")
    assert e.value.code == errors.AMOUNT_INVALID
    assert await ledger.balance(core.db, u) == 0
    assert await _journal_rows(core.db) == 0


async def test_a_debit_below_zero_rolls_back_its_journal_row(core: Core) -> None:
    u = await ledger.create_user(core.db, "li")
    await ledger.topup(core.db, u, 100, "r1")

    async def overdraw(tx: object) -> bool:
        return await journal.post(tx, u, -101, "send", "overdraw")  # type: ignore[arg-type]

    with pytest.raises(Conflict) as e:
        await core.db.run(overdraw, idempotent=True)
    assert e.value.code == errors.INSUFFICIENT_FUNDS
    assert await ledger.balance(core.db, u) == 100
    assert await _journal_rows(core.db) == 1


async def test_names_are_unique(core: Core) -> None:
    await ledger.create_user(core.db, "wang")
    with pytest.raises(Conflict) as e:
        await ledger.create_user(core.db, "wang")
    assert e.value.code == errors.NAME_TAKEN
    with pytest.raises(InvalidRequest):
        await ledger.create_user(core.db, "  ")


async def test_migrations_run_once(sqlite_db: Database) -> None:
    from server.store.schema import migrate

    assert await migrate(sqlite_db) == []


async def test_a_program_older_than_the_schema_does_not_start_on_it(sqlite_db: Database) -> None:
    """An old process would read rows it does not know as rows it does (a credit batch's one event row
    as one event): refused, naming the versions, and nothing changed."""
    from server.store.db import DatabaseError
    from server.store.schema import LATEST, migrate

    newer = LATEST + 1
    await sqlite_db.run(
        lambda tx: tx.execute(
            "INSERT INTO schema_migrations (version, name, applied_ms) VALUES (%s, 'from the future', 0)",
            (newer,),
        ),
        idempotent=False,
    )
    try:
        with pytest.raises(DatabaseError, match=rf"migration\(s\) \[{newer}\], newer than this program"):
            await migrate(sqlite_db)
    finally:
        await sqlite_db.run(
            lambda tx: tx.execute("DELETE FROM schema_migrations WHERE version = %s", (newer,)),
            idempotent=False,
        )


async def test_a_program_that_waited_for_the_lease_while_a_newer_one_migrated_does_not_start(
    sqlite_db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    from contextlib import asynccontextmanager

    from server.store import schema
    from server.store.db import DatabaseError

    mine, theirs = schema.LATEST + 1, schema.LATEST + 2
    monkeypatch.setattr(schema, "MIGRATIONS", [*schema.MIGRATIONS, (mine, "due here", [])])

    @asynccontextmanager
    async def newer_program_migrated_meanwhile(db: Database, held: str | None) -> Any:
        await db.run(
            lambda tx: tx.execute(
                "INSERT INTO schema_migrations (version, name, applied_ms) VALUES (%s, 'x', 0), (%s, 'y', 0)",
                (mine, theirs),
            ),
            idempotent=False,
        )
        yield "lease"

    monkeypatch.setattr(schema, "_lease", newer_program_migrated_meanwhile)
    try:
        with pytest.raises(DatabaseError, match=rf"migration\(s\) \[{theirs}\], newer than this program"):
            await schema.migrate(sqlite_db)
    finally:
        await sqlite_db.run(
            lambda tx: tx.execute("DELETE FROM schema_migrations WHERE version IN (%s, %s)", (mine, theirs)),
            idempotent=False,
        )


async def test_keys_that_differ_only_by_trailing_spaces_are_different_keys(core: Core) -> None:
    """MariaDB's utf8mb4_bin pads with spaces ("r1" = "r1 "); the keys are bytes there, as in SQLite."""
    u = await ledger.create_user(core.db, "li")

    async def posts(tx: Tx) -> list[bool]:
        return [await journal.post(tx, u, 5, "topup", key) for key in ("k", "k ", " k")]

    assert await core.db.run(posts, idempotent=True) == [True, True, True]
    assert await ledger.balance(core.db, u) == 15
    w = await make_world(core, members=1)
    p = await packets.send_packet(
        core, sender_id=w.admin, group_id=w.group, kind="lucky", total=100, count=1, request_id="x"
    )

    async def same_sender_spaced_key(tx: Tx) -> int:
        return await tx.execute(
            "UPDATE red_packets SET request_id = %s WHERE id = %s", ("x ", p.packet_id)
        ) + await tx.execute(
            "INSERT INTO red_packets (sender_id, group_id, kind, total, share_count, greeting, status,"
            " request_id, created_ms, expires_ms) VALUES (%s, %s, 'lucky', 1, 1, '', 'refunded', 'x', 0, 0)",
            (w.admin, w.group),
        )

    assert await core.db.run(same_sender_spaced_key, idempotent=False) == 2


async def test_request_ids_that_differ_from_another_only_invisibly_are_refused(core: Core) -> None:
    """Whitespace at either end, control and invisible characters: refused as bad requests, nothing moved
    (a key is compared byte for byte, so such a key would be taken for a new request)."""
    w = await make_world(core, members=2, admin_cents=10_000)
    for bad in (" r1", "r1 ", "r\t1", "r\u200b1", "", "x" * 65, 17):
        with pytest.raises(RedPacketError) as e:
            await ledger.topup(core.db, w.admin, 100, bad)
        assert e.value.code == errors.BAD_REQUEST
        with pytest.raises(RedPacketError) as e:
            await packets.send_packet(
                core, sender_id=w.admin, group_id=w.group, kind="lucky", total=100, count=1, request_id=bad
            )  # type: ignore[arg-type]
        assert e.value.code == errors.BAD_REQUEST
    assert await ledger.balance(core.db, w.admin) == 10_000
    row = await core.db.fetchone("SELECT COUNT(*) FROM red_packets")
    assert row is not None and int(row[0]) == 0
