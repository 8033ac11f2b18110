"""The ledger on both dialects: every change a journal row, idempotent keys, balances never negative."""

from __future__ import annotations

import pytest

from server import errors
from server.core import Core
from server.errors import Conflict, InvalidRequest
from server.money import ledger
from server.store.db import Database


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
    assert await ledger.journal_sum(core.db, u) == 750
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
        return await ledger.post(tx, u, -101, "send", "overdraw")  # type: ignore[arg-type]

    with pytest.raises(Conflict) as e:
        await core.db.run(overdraw)
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
