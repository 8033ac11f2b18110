"""Reconciliation sees every way the money can go wrong: real books spoiled in the database and in Redis
the way a bug would spoil them, on both dialects. (The pure arithmetic on hand-made books:
``tests/unit/test_reconcile.py``.)"""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from server.core import Core
from server.money import grabs, ledger, packets, settlement
from server.money.reconcile import LATE_MS, reconcile
from server.settings import Settings
from server.store import keys
from tests.books import run_worker
from tests.conftest import make_world


async def test_a_posting_to_someone_elses_account_is_found(core: Core) -> None:
    w = await make_world(core, members=2, admin_cents=10_000)
    p = await packets.send_packet(core, sender_id=w.admin, group_id=w.group, kind="lucky", total=500, count=2)
    for u in w.members:
        await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=u)
    await run_worker(core)
    assert (await reconcile(core)).ok
    a, b = w.members

    async def misdirect(tx: object) -> int:
        # A credit posted to the wrong member (both accounts still sum to their journals).
        return await tx.execute(  # type: ignore[attr-defined,no-any-return]
            "UPDATE journal SET account_id = %s WHERE kind = 'grab' AND account_id = %s", (b, a)
        )

    await core.db.run(misdirect, idempotent=False)
    assert "grab_posting" in (await reconcile(core)).checks()


async def test_shares_that_do_not_add_up_are_found(core: Core) -> None:
    w = await make_world(core, members=2, admin_cents=10_000)
    p = await packets.send_packet(core, sender_id=w.admin, group_id=w.group, kind="lucky", total=500, count=2)

    async def shave(tx: object) -> int:
        return await tx.execute(  # type: ignore[attr-defined,no-any-return]
            "UPDATE red_packet_shares SET amount = amount - 1 WHERE packet_id = %s AND seq = 1",
            (p.packet_id,),
        )

    await core.db.run(shave, idempotent=False)
    assert "packet_shares" in (await reconcile(core)).checks()


async def test_an_expired_packet_nobody_settled_is_found(core: Core) -> None:
    w = await make_world(core, members=2, admin_cents=10_000)
    p = await packets.send_packet(core, sender_id=w.admin, group_id=w.group, kind="lucky", total=500, count=2)
    assert (await reconcile(core, now=p.expires_ms + LATE_MS - 1)).ok
    late = await reconcile(core, now=p.expires_ms + LATE_MS + 1)
    assert "packet_stuck" in late.checks()
    await settlement.refund_packet(core, p.packet_id, now=p.expires_ms + 1)
    assert (await reconcile(core, now=p.expires_ms + LATE_MS + 1)).ok


async def test_what_redis_told_is_checked_against_the_ledger(core: Core) -> None:
    w = await make_world(core, members=3, admin_cents=10_000)
    p = await packets.send_packet(core, sender_id=w.admin, group_id=w.group, kind="lucky", total=900, count=3)
    a, b, c = w.members
    mine = (await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=a)).grab
    theirs = (await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=b)).grab
    # Not yet paid: no difference while young, one once late.
    assert (await reconcile(core)).ok
    assert "redis_grab_unpaid" in (await reconcile(core, now=ledger.now_ms() + LATE_MS + 1)).checks()
    await run_worker(core)
    assert (await reconcile(core, now=ledger.now_ms() + LATE_MS + 1)).ok
    # Redis tells c it holds a's share (as a lost write handed out again would): found at once.
    grabs_key = keys.packet_grabs(group_id=w.group, packet_id=p.packet_id)
    await core.redis.hset(grabs_key, str(c), f"{mine.seq}:{mine.amount}:{ledger.now_ms()}")
    report = await reconcile(core)
    assert [d.check for d in report.differences] == ["redis_grab"], report.differences
    # And b holding another share than the ledger says.
    await core.redis.hdel(grabs_key, str(c))
    await core.redis.hset(grabs_key, str(b), f"{theirs.seq + 1}:{theirs.amount}:{ledger.now_ms()}")
    assert "redis_grab" in (await reconcile(core)).checks()


async def test_a_workers_reconciliation_runs_in_a_process_of_its_own(
    core: Core, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker's job reconciles in a child process (``redpacket reconcile --json`` on the worker's own
    settings): on a thread of the worker a big ledger's reconciliation shared the interpreter's lock with
    the loop that pays credits, and a storm's credit lag P99 went from 61 to 233–405 ms
    (docs/benchmarks.md). Here this process's reconciliation cannot run at all, and the job still finds the
    books clean, then a cent out of place."""
    from server.money import reconcile as module
    from worker.settle import Ctx, reconcile_job

    def not_here(*args: Any) -> Any:
        raise AssertionError("the worker reconciled on its own process")

    w = await make_world(core, members=1, admin_cents=10_000)
    monkeypatch.setattr(module, "gather", not_here)
    monkeypatch.setattr(module, "check", not_here)
    ctx: Ctx = {"core": core}
    assert await reconcile_job(ctx) == 0
    await core.db.run(
        lambda tx: tx.execute("UPDATE accounts SET balance = balance + 1 WHERE user_id = %s", (w.admin,)),
        idempotent=False,
    )
    assert await reconcile_job(ctx) == 2  # account_journal and global


async def test_a_workers_reconciliation_that_made_no_report_says_why(redis_url: str, tmp_path: Path) -> None:
    """The child made no report (here: a database behind the code, which it never migrates): the job
    fails naming the child's exit code and what it said, not "not a report"."""
    from worker.settle import ReconcileFailed, reconcile_in_child

    empty = tmp_path / "ledger.sqlite3"
    empty.touch()
    settings = Settings(redis_url=redis_url, database_url=f"sqlite:///{empty}")
    with pytest.raises(ReconcileFailed, match=r"exited 2 with no report: .*run `redpacket migrate` first"):
        await reconcile_in_child(settings)
    with contextlib.closing(sqlite3.connect(empty)) as made:  # (and no table was made in it)
        assert made.execute("SELECT COUNT(*) FROM sqlite_master").fetchone() == (0,)
