"""The ledger sharded over three MariaDB backends by a Spider head (``server.store.shards``,
``server.money.shardsteps``), on real servers.

What ``redpacket migrate`` makes (Spider tables, rows on backend ``id % 3``, unique keys that refuse a
double payment within a shard); a worker killed between each pair of steps of a credit, a refund and a
send, and another worker (or the sweeper) finishing the work with nothing paid twice; reconciliation
catching a row corrupted on one backend and naming its shard; and a storm of sends and grabs through two
hub processes, paid by two worker processes, while one backend is killed with ``kill -9`` and started
again: every "won" credited exactly once once it is back, every step applied once, the books clean.

The rest of the money suite runs on the sharded ledger too (``tests/conftest.py``, ``SHARDED_SUITE``).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from typing import Any

import pytest

from launchers.spider import SpiderCluster
from server import errors
from server.core import Core, open_core
from server.errors import RedPacketError
from server.ids import ShareSeq, UserId
from server.money import creditrules, grabs, journal, ledger, packets, payouts, settlement, shardsteps
from server.money import reconcile as reconciling
from server.money.crediting import credit_many
from server.money.reconcile import reconcile
from server.settings import Settings
from server.store import shards
from server.store.db import DatabaseError, Unreachable
from server.store.engines import connect
from server.store.records import CreditEntry
from server.store.shards import make_sharded, shard_of
from tests.books import credited_count, credited_is
from tests.conftest import make_world, name_deployment, rows_at
from tests.hubtools import eventually, hub_process, worker_env
from tests.storms import Storm, grabber, sender, storm_world

ON_SHARDS = pytest.mark.parametrize("core", ["spider"], indirect=True)


async def _backend_urls(core: Core) -> list[str]:
    """The backends of the test's head, as ``migrate`` registered them there, in shard order."""
    rows = await core.db.fetchall("SELECT Server_name, Port, Db FROM mysql.servers ORDER BY Server_name")
    mine = {str(n): (int(p), str(d)) for n, p, d in rows}
    return [
        "mysql://root@127.0.0.1:{}/{}".format(*mine[shards.server_name("redpacket_test", i)])
        for i in range(core.db.shards)
    ]


@ON_SHARDS
async def test_migrate_makes_spider_tables_and_rows_land_on_their_shard(core: Core) -> None:
    assert core.db.shards == 3
    engines = dict(
        await core.db.fetchall(
            "SELECT table_name, engine FROM information_schema.tables WHERE table_schema = DATABASE()"
        )
    )
    for table in shards.SHARDED:
        assert engines[table] == "SPIDER", table
    assert engines["users"] == engines["chat_groups"] == "InnoDB"  # the head's own
    w = await make_world(core, members=5)
    urls = await _backend_urls(core)
    for i, url in enumerate(urls):
        held = {int(r[0]) for r in await rows_at(url, "SELECT user_id FROM accounts")}
        assert held == {u for u in [w.admin, *w.members] if u % 3 == i}, i
    # A share of a packet is held once on its packet's shard, whoever asks through the head.
    p = await packets.send_packet(core, sender_id=w.admin, group_id=w.group, kind="equal", total=300, count=3)
    url = urls[p.packet_id % 3]
    assert len(await rows_at(url, f"SELECT seq FROM red_packet_shares WHERE packet_id = {p.packet_id}")) == 3


async def _grabbed(core: Core, w: Any, n: int = 3) -> list[CreditEntry]:
    """A packet of ``n`` shares grabbed by ``n`` members; the credits Redis queued for them."""
    p = await packets.send_packet(core, sender_id=w.admin, group_id=w.group, kind="lucky", total=900, count=n)
    out = []
    for u in w.members[:n]:
        got = (await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=u)).grab
        assert got is not None
        out.append(CreditEntry(p.packet_id, UserId(u), ShareSeq(got.seq), got.amount, got.grabbed_ms))
    return out


class Killed(Exception):
    """The worker's process ends here (what ``kill -9`` does between two transactions)."""


async def killed(*_: object) -> None:
    """A step put in place of the real one: the process dies before it."""
    raise Killed


async def _balances(core: Core, users: list[int]) -> dict[int, int]:
    return {u: await ledger.balance(core.db, UserId(u)) for u in users}


@ON_SHARDS
@pytest.mark.parametrize("dies_before", ["pay", "close"])
async def test_a_credit_worker_killed_between_steps_leaves_work_another_finishes_once(
    core: Core, monkeypatch: pytest.MonkeyPatch, dies_before: str
) -> None:
    w = await make_world(core, members=3)
    credits = await _grabbed(core, w)

    with monkeypatch.context() as m:
        m.setattr(shardsteps, f"_{dies_before}", killed)
        with pytest.raises(Killed):
            await credit_many(core.db, credits)
    # The dangerous state: every record decided (``crediting``), and paid or not as the step says.
    rows = await core.db.fetchall("SELECT status FROM grab_records")
    assert [r[0] for r in rows] == ["crediting"] * 3
    posted = await core.db.fetchone("SELECT COUNT(*) FROM journal WHERE kind = 'grab'")
    assert posted is not None and int(posted[0]) == (3 if dies_before == "close" else 0)
    assert (await reconcile(core)).ok  # between steps, young: in flight, not a difference
    # Another worker takes the same outbox entries over.
    again = await credit_many(core.db, credits)
    assert again == (["already"] * 3 if dies_before == "close" else ["credited"] * 3)
    assert await _balances(core, w.members[:3]) == {c.user_id: c.amount for c in credits}
    posted = await core.db.fetchone("SELECT COUNT(*), SUM(amount) FROM journal WHERE kind = 'grab'")
    assert posted is not None and (int(posted[0]), int(posted[1])) == (3, 900)  # each step once
    assert {r[0] for r in await core.db.fetchall("SELECT status FROM grab_records")} == {"credited"}
    assert (await packets.load_packet(core, credits[0].packet_id)).status == "finished"  # type: ignore[union-attr]
    assert (await reconcile(core)).ok


@ON_SHARDS
async def test_the_drain_pays_the_shards_it_reaches_and_gives_back_the_credits_of_one_it_cannot(
    core: Core, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = await make_world(core, members=6)
    credits = await _grabbed(core, w, n=6)
    away = credits[0].user_id % 3  # a user shard whose backend cannot be reached now
    real_pay = shardsteps._pay

    async def pay(tx: Any, batch: list[CreditEntry]) -> Any:
        if batch[0].user_id % 3 == away:
            raise Unreachable("(1429, 'Unable to connect to foreign data source')")
        return await real_pay(tx, batch)

    with monkeypatch.context() as m:
        m.setattr(shardsteps, "_pay", pay)
        got = await credit_many(core.db, credits, partial=True)  # (the drain's call)
    assert got == [creditrules.LATER if c.user_id % 3 == away else "credited" for c in credits]
    paid = {c.user_id: c.amount for c in credits if c.user_id % 3 != away}
    assert await _balances(core, [c.user_id for c in credits]) == {
        c.user_id: paid.get(c.user_id, 0) for c in credits
    }
    # Back: the credits given back are paid, once; the others were.
    again = await credit_many(core.db, credits, partial=True)
    assert again == ["credited" if c.user_id % 3 == away else "already" for c in credits]
    assert await _balances(core, [c.user_id for c in credits]) == {c.user_id: c.amount for c in credits}
    assert (await reconcile(core)).ok


@ON_SHARDS
async def test_a_credit_whose_outbox_entry_is_gone_is_finished_by_the_sweeper_and_late_ones_are_reported(
    core: Core, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = await make_world(core, members=3)
    credits = await _grabbed(core, w)

    with monkeypatch.context() as m:
        m.setattr(shardsteps, "_pay", killed)
        with pytest.raises(Killed):
            await credit_many(core.db, credits)
    late = credits[0].grabbed_ms + 16 * 60 * 1000
    report = await reconcile(core, now=late)
    assert report.checks() >= {"credit_unfinished"}, report.differences
    assert await shardsteps.complete_stranded(core.db, late) == 3
    assert await _balances(core, w.members[:3]) == {c.user_id: c.amount for c in credits}
    assert await shardsteps.complete_stranded(core.db, late) == 0
    assert "credit_unfinished" not in (await reconcile(core, now=late)).checks()


@ON_SHARDS
@pytest.mark.parametrize("dies_before", ["retry", "void"])
async def test_a_send_killed_between_its_debit_and_its_packet_is_made_or_refunded_never_both(
    core: Core, monkeypatch: pytest.MonkeyPatch, dies_before: str
) -> None:
    w = await make_world(core, members=3, admin_cents=10_000)

    with monkeypatch.context() as m:
        m.setattr(shardsteps, "create_packet", killed)
        with pytest.raises(Killed):
            await packets.send_packet(
                core, sender_id=w.admin, group_id=w.group, kind="lucky", total=600, count=3, request_id="r1"
            )
    assert await ledger.balance(core.db, UserId(w.admin)) == 9_400  # debited: the dangerous state
    assert await core.db.fetchone("SELECT 1 FROM red_packets") is None
    report = await reconcile(core)  # debited, not made: held, and young, so not a difference yet
    assert report.ok and report.held_in_packets == 600, report.differences
    later = int(time.time() * 1000) + 16 * 60 * 1000
    assert "send_unfinished" in (await reconcile(core, now=later)).checks()
    if dies_before == "retry":  # the client's retry with its request id completes it, once
        p = await packets.send_packet(
            core, sender_id=w.admin, group_id=w.group, kind="lucky", total=600, count=3, request_id="r1"
        )
        assert not p.replay and p.published  # made now: put up in Redis now
        got = await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=w.members[0])
        assert got.outcome == "won"
        assert await ledger.balance(core.db, UserId(w.admin)) == 9_400
    else:  # nobody retried: the sweeper refunds it, and a late retry is refused, not made
        later = int(time.time() * 1000) + shardsteps.UNSENT_MS + 1
        assert await shardsteps.void_unsent(core.db, later, 0) == 1
        assert await shardsteps.void_unsent(core.db, later, 0) == 0
        assert await ledger.balance(core.db, UserId(w.admin)) == 10_000
        with pytest.raises(RedPacketError) as e:
            await packets.send_packet(
                core, sender_id=w.admin, group_id=w.group, kind="lucky", total=600, count=3, request_id="r1"
            )
        assert e.value.code == errors.IDEMPOTENCY_KEY_REUSED
        assert await ledger.balance(core.db, UserId(w.admin)) == 10_000
    assert (await reconcile(core)).ok


class _Resumed:
    """A Database whose every run is a run again after a lost COMMIT answer (``Tx.resumed``)."""

    def __init__(self, db: Any) -> None:
        self.db = db

    async def run(self, work: Any, *, idempotent: bool) -> Any:
        async def again(tx: Any) -> Any:
            tx.resumed = True
            return await work(tx)

        return await self.db.run(again, idempotent=idempotent)


@ON_SHARDS
async def test_a_send_whose_packet_commit_answer_is_lost_knows_its_own_packet_by_its_seed(
    core: Core, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The packet's step committed and its answer was lost: the run again finds the row and must tell
    this call's (its seed) from another call's of the same request (a replay), or the sender is answered
    "replay" for the packet just paid for, and it is not put up in Redis."""
    real = shardsteps.create_packet
    answers: list[bool] = []

    async def answer_lost(db: Any, packet_id: Any, made_by: tuple[int, str, str], insert: Any) -> bool:
        assert await real(db, packet_id, made_by, insert)  # committed: the answer never came back
        answers.append(await real(_Resumed(db), packet_id, (made_by[0], made_by[1], "ab" * 32), insert))
        answers.append(await real(_Resumed(db), packet_id, made_by, insert))
        return answers[-1]

    w = await make_world(core, members=3, admin_cents=10_000)
    monkeypatch.setattr(shardsteps, "create_packet", answer_lost)
    p = await packets.send_packet(
        core, sender_id=w.admin, group_id=w.group, kind="lucky", total=600, count=3, request_id="r1"
    )
    assert answers == [False, True]  # another seed: another call's row; its own seed: this call's
    assert not p.replay and p.published
    got = await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=w.members[0])
    assert got.outcome == "won" and await ledger.balance(core.db, UserId(w.admin)) == 9_400
    assert (await reconcile(core)).ok


@ON_SHARDS
@pytest.mark.parametrize("dies_before", ["pay", "close"])
async def test_a_refund_killed_between_steps_pays_back_once(
    core: Core, monkeypatch: pytest.MonkeyPatch, dies_before: str
) -> None:
    w = await make_world(core, members=3, admin_cents=10_000)
    p = await packets.send_packet(core, sender_id=w.admin, group_id=w.group, kind="lucky", total=600, count=3)
    got = (await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=w.members[0])).grab
    assert got is not None
    real_run = core.db.run
    steps: list[str] = []

    async def dying_run(work: Any, *, idempotent: bool, attempts: int = 8) -> Any:
        name = getattr(work, "__name__", "")
        steps.append(name)
        if name == dies_before and steps.count(name) == 1:
            raise Killed
        return await real_run(work, idempotent=idempotent, attempts=attempts)

    after = p.expires_ms + 1
    with monkeypatch.context() as m:
        m.setattr(core.db, "run", dying_run)
        with pytest.raises(Killed):
            await settlement.refund_packet(core, p.packet_id, now=after)
    assert "decide_left" in steps  # the refund was decided on the packet's shard before the death
    assert (await packets.load_packet(core, p.packet_id)).status == "refunding"  # type: ignore[union-attr]
    r = await settlement.refund_packet(core, p.packet_id, now=after)  # the next run of the refund job
    assert (r.outcome, r.amount) == ("refunded", 600 - got.amount)
    assert await ledger.balance(core.db, UserId(w.admin)) == 10_000 - got.amount
    assert await ledger.balance(core.db, UserId(w.members[0])) == got.amount
    refunds = await core.db.fetchone("SELECT COUNT(*) FROM journal WHERE kind = 'refund'")
    assert refunds is not None and int(refunds[0]) == 1
    assert (await reconcile(core, now=after)).ok


@ON_SHARDS
async def test_reconciliation_catches_a_row_changed_on_one_backend_and_names_its_shard(
    core: Core, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = await make_world(core, members=3)
    credits = await _grabbed(core, w)
    await credit_many(core.db, credits)
    report = await reconcile(core)
    assert report.ok and len(report.shards) == 3, report
    victim = credits[1]
    backend = await connect((await _backend_urls(core))[victim.user_id % 3], 1)
    try:  # a cent more on one balance, written on its backend behind the head's back
        await backend.run(
            lambda tx: tx.execute(
                "UPDATE accounts SET balance = balance + 1 WHERE user_id = %s", (victim.user_id,)
            ),
            idempotent=False,
        )
    finally:
        await backend.close()
    # Money moves between reconciliation's two reads of the shards (a top-up): the cent still shows.
    real_gather, reads = reconciling.gather, []

    async def gather_while_money_moves(c: Core, now: int | None = None, progress: Any = None) -> Any:
        reads.append(now)
        books = await real_gather(c, now)
        await ledger.topup(core.db, UserId(w.admin), 500, f"meanwhile-{len(reads)}")
        return books

    monkeypatch.setattr(reconciling, "gather", gather_while_money_moves)
    report = await reconcile(core)
    assert len(reads) == 2 and reads[0] == reads[1]  # read twice, at one time
    assert "account_journal" in report.checks() and "global" in report.checks(), report.differences
    line = report.shards[victim.user_id % 3]
    assert line.endswith("differences 1"), report.shards
    assert all(s.endswith("differences 0") for i, s in enumerate(report.shards) if i != victim.user_id % 3)


# --- a storm through real processes, one backend killed and started again ---


async def _sharded_database(cluster: SpiderCluster, name: str) -> str:
    await cluster.create_database(name)
    head = await connect(cluster.head_url(name), 1)
    try:
        await make_sharded(head, name, cluster.backend_urls(name), lambda url: connect(url, 1))
    finally:
        await head.close()
    await name_deployment(cluster.head_url(name))
    return cluster.head_url(name)


async def test_holds_go_on_on_the_backends_that_answer_while_another_is_down(
    spider: SpiderCluster, hub_settings: Settings
) -> None:
    """Before: every hold, confirm, release, look-up and expiry found its hold by request id alone, which
    the head asks of every backend (holds are partitioned by user) — one backend down stopped holds for
    everyone. Each now names its user's shard (from the request id's claim on the head)."""
    url = await _sharded_database(spider, "holds")
    async with open_core(hub_settings.replace(database_url=url), migrate=False) as core:
        users = await ledger.create_users(core.db, [f"holder{i}" for i in range(9)])
        for u in users:
            await ledger.topup(core.db, u, 1_000, f"holder-topup-{u}")
        down = 1
        here = next(u for u in users if shard_of(u, core.db.shards) != down)
        there = next(u for u in users if shard_of(u, core.db.shards) == down)
        await payouts.hold(core.db, here, 100, "hold-due")  # its time over: found expired while down
        await core.db.run(
            lambda tx: tx.execute(
                "UPDATE holds SET expires_ms = %s WHERE request_id = %s AND user_id = %s",
                (ledger.now_ms() - 1, "hold-due", here),
            ),
            idempotent=True,
        )
        doomed = spider.backends[down]
        doomed.kill()
        try:
            with pytest.raises(DatabaseError):  # the backend is down: its users' holds cannot be made
                await payouts.hold(core.db, there, 100, "hold-there")
            await payouts.hold(core.db, here, 200, "hold-1")
            assert (await payouts.settle_hold(core.db, "hold-1", "confirmed")).state == "confirmed"
            await payouts.hold(core.db, here, 300, "hold-2")
            assert (await payouts.settle_hold(core.db, "hold-2", "released")).state == "released"
            assert (await payouts.get_hold(core.db, "hold-1")).state == "confirmed"
            with pytest.raises(DatabaseError):  # no claim: it may be a hold older than claims, anywhere
                await payouts.get_hold(core.db, "hold-never")
            with pytest.raises(RedPacketError) as late:  # a confirm too late: the expiry is kept
                await payouts.settle_hold(core.db, "hold-due", "confirmed")
            assert late.value.code == errors.HOLD_CLOSED
            assert (await payouts.get_hold(core.db, "hold-due")).state == "expired"
        finally:
            await doomed.start()
        assert await payouts.expire_due(core.db) == 0  # (its scan reads every backend: run once all answer)
        with pytest.raises(RedPacketError) as none:
            await payouts.get_hold(core.db, "hold-never")
        assert none.value.code == errors.HOLD_NOT_FOUND
        # A hold with no claim (made before claims were kept) is found by its request id alone.
        await payouts.hold(core.db, here, 50, "hold-old")
        await core.db.run(
            lambda tx: tx.execute("DELETE FROM request_claims WHERE idem_key = %s", ("hold:hold-old",)),
            idempotent=True,
        )
        assert (await payouts.settle_hold(core.db, "hold-old", "released")).state == "released"
        assert await ledger.balance(core.db, here) == 1_000 - 200  # the confirmed hold has left
        assert (await reconcile(core)).ok


async def test_a_storm_with_a_backend_killed_and_started_again_credits_every_won_once(
    spider: SpiderCluster, hub_settings: Settings
) -> None:
    url = await _sharded_database(spider, "storm")
    s = hub_settings.replace(database_url=url)
    doomed = spider.backends[1]
    workers = [
        subprocess.Popen(  # noqa: ASYNC220 - the two workers under test
            [sys.executable, "-m", "server", "worker"], env=worker_env(s), stdout=subprocess.DEVNULL
        )
        for _ in range(2)
    ]
    storm = Storm()
    try:
        async with hub_process(s) as a, hub_process(s) as b, open_core(s, migrate=False) as look:
            admin_token, people, groups = await storm_world(a)
            queue: asyncio.Queue[Any] = asyncio.Queue()
            lanes = [asyncio.create_task(sender(h, admin_token, groups, storm, queue)) for h in (a, b)]
            grabbers = [asyncio.create_task(grabber((a, b), people, storm, queue)) for _ in range(3)]
            try:
                # The dangerous state first: grabs told "won" and not yet credited, sends going on.
                async def backlog() -> bool:
                    return len(storm.told) >= 30 and await credited_count(look.db) < len(storm.told)

                await eventually(backlog, 60)
                storm.killed_at = time.monotonic()
                doomed.kill()
                # Users see it: sends that need its shard answer database_unavailable (grabs, in
                # Redis, go on while there are packets to grab).
                await eventually(lambda: sum(t > storm.killed_at for t in storm.send_errors_at) >= 2, 90)
                await doomed.start()
                restarted = time.monotonic()
                await eventually(lambda: sum(asked > restarted for asked, _ in storm.send_ok_at) >= 5, 90)
            finally:
                storm.stop.set()
                for t in lanes:
                    await t
                await queue.join()
                for t in grabbers:
                    t.cancel()
            assert a.process is not None and b.process is not None
            assert a.process.poll() is None and b.process.poll() is None, "a hub process died"
        assert all(w.poll() is None for w in workers), "a worker process died"
        async with open_core(s, migrate=False) as core:
            await eventually(lambda: credited_is(core.db, len(storm.told)), 120)
            rows = await core.db.fetchall(
                "SELECT packet_id, user_id, amount FROM grab_records WHERE status = 'credited'"
            )
            assert {(int(p), int(u)): int(m) for p, u, m in rows} == storm.told
            posted = await core.db.fetchall(
                "SELECT packet_id, account_id, amount FROM journal WHERE kind = 'grab'"
            )
            assert sorted((int(p), int(u), int(m)) for p, u, m in posted) == sorted(
                (p, u, m) for (p, u), m in storm.told.items()
            )  # each credit posted once: no step applied twice
            made = await core.db.fetchall("SELECT id FROM red_packets")
            assert sorted(int(r[0]) for r in made) == sorted(storm.sent.values())
            debits = await core.db.fetchone("SELECT COUNT(*) FROM journal WHERE kind = 'send'")
            assert debits is not None and int(debits[0]) == len(storm.sent)
            report = await reconcile(core)
            assert report.ok, report.differences
        answered = [done for asked, done in storm.send_ok_at if asked > storm.killed_at]
        print(
            f"backend {doomed.name} killed: {len(storm.told)} grabs told, {len(storm.sent)} sends,"
            f" {len(storm.send_errors_at)} send attempts answered database_unavailable;"
            f" sends answered again {min(answered) - storm.killed_at:.2f} s after the kill"
        )
    finally:
        for w in workers:
            w.terminate()
            await asyncio.to_thread(w.wait, 30)


async def _unclaimed_share(core: Core, packet_id: int, user: int) -> CreditEntry:
    """A credit of a share nobody was paid, for ``user``: what a credit still in flight brings."""
    taken = {
        int(r[0])
        for r in await core.db.fetchall("SELECT seq FROM grab_records WHERE packet_id = %s", (packet_id,))
    }
    rows = await core.db.fetchall(
        "SELECT seq, amount FROM red_packet_shares WHERE packet_id = %s ORDER BY seq", (packet_id,)
    )
    seq, amount = next((int(s), int(a)) for s, a in rows if int(s) not in taken)
    return CreditEntry(packet_id, UserId(user), ShareSeq(seq), amount, 1)


async def _paid_out(core: Core, packet_id: int) -> int:
    """Everything the journal paid out of the packet: its shares credited and its refund."""
    row = await core.db.fetchone(
        "SELECT COALESCE(SUM(amount), 0) FROM journal WHERE packet_id = %s AND kind IN ('grab', 'refund')",
        (packet_id,),
    )
    return int(row[0]) if row else 0


@ON_SHARDS
async def test_a_sharded_refund_counts_a_credit_half_way_as_paid(
    core: Core, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Audit of issue 44: with the refund's ``crediting`` removed from what it counts as paid, all 25
    sharded tests passed. A credit decided on the packet's shard (its record ``crediting``) but not yet
    posted when the refund decides: the refund must leave its share out, or the share is paid twice."""
    w = await make_world(core, members=3, admin_cents=10_000)
    p = await packets.send_packet(core, sender_id=w.admin, group_id=w.group, kind="lucky", total=900, count=3)
    await core.db.run(
        lambda tx: tx.execute("UPDATE red_packets SET status = 'refunding' WHERE id = %s", (p.packet_id,)),
        idempotent=True,
    )
    half_way = await _unclaimed_share(core, p.packet_id, w.members[0])
    with monkeypatch.context() as m:  # a worker dies after step 1 of the credit
        m.setattr(shardsteps, "_pay", killed)
        with pytest.raises(Killed):
            await credit_many(core.db, [half_way])
    rows = await core.db.fetchall("SELECT status FROM grab_records WHERE packet_id = %s", (p.packet_id,))
    assert [r[0] for r in rows] == ["crediting"]  # the dangerous state, while the refund decides
    r = await shardsteps.refund(core.db, p.packet_id, p.expires_ms + 1)
    assert (r.outcome, r.amount) == ("refunded", 900 - half_way.amount)
    assert await credit_many(core.db, [half_way]) == ["credited"]  # another worker finishes the credit
    assert await _paid_out(core, p.packet_id) == 900
    assert (await reconcile(core, now=p.expires_ms + 1)).ok


@ON_SHARDS
async def test_a_decided_sharded_refund_refuses_a_credit_that_comes_after(
    core: Core, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Audit of issue 44: with the refund's decision (``finished_ms`` on a ``refunding`` packet) not taken
    as ``refunded`` by a credit's first step, all 15 sharded tests passed. A credit that reaches the
    packet's shard after the refund decided what is left must be refused (and recorded), or its share is
    paid to the grabber and paid back to the sender."""
    w = await make_world(core, members=3, admin_cents=10_000)
    p = await packets.send_packet(core, sender_id=w.admin, group_id=w.group, kind="lucky", total=900, count=3)
    await core.db.run(
        lambda tx: tx.execute("UPDATE red_packets SET status = 'refunding' WHERE id = %s", (p.packet_id,)),
        idempotent=True,
    )
    late = await _unclaimed_share(core, p.packet_id, w.members[0])
    real_run, seen = core.db.run, []

    async def credit_between(work: Any, *, idempotent: bool, attempts: int = 8) -> Any:
        if getattr(work, "__name__", "") == "pay" and not seen:  # decided, not yet paid back
            decided = await core.db.fetchone(
                "SELECT status, finished_ms FROM red_packets WHERE id = %s", (p.packet_id,)
            )
            assert decided is not None and decided[0] == "refunding" and decided[1] is not None  # the state
            seen.append(await credit_many(core.db, [late]))  # the late credit comes now
        return await real_run(work, idempotent=idempotent, attempts=attempts)

    with monkeypatch.context() as m:
        m.setattr(core.db, "run", credit_between)
        r = await shardsteps.refund(core.db, p.packet_id, p.expires_ms + 1)
    assert seen == [[errors.PACKET_EXPIRED]]
    assert (r.outcome, r.amount) == ("refunded", 900)
    assert await ledger.balance(core.db, UserId(w.members[0])) == 0
    assert await _paid_out(core, p.packet_id) == 900
    # The refused credit is reported as such (its grabber was told "won"), and nothing else is wrong.
    report = await reconcile(core, now=p.expires_ms + 1)
    assert [d.check for d in report.differences] == ["credit_refused"], report
    refused = await core.db.fetchone("SELECT code FROM credit_refusals WHERE packet_id = %s", (p.packet_id,))
    assert refused is not None and refused[0] == errors.PACKET_EXPIRED


@ON_SHARDS
async def test_a_sharded_refund_finishes_a_packet_only_once_its_last_share_is_paid(
    core: Core, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Audit of issue 44: a refund with nothing to pay back marked the packet ``finished`` and published
    ``packet.finished`` while a share was still on its way (its record ``crediting``). Now the refund
    leaves it ``refunding`` until the share is paid, and its next run finishes it."""
    w = await make_world(core, members=3, admin_cents=10_000)
    credits = await _grabbed(core, w)
    assert await credit_many(core.db, credits[:2]) == ["credited"] * 2
    with monkeypatch.context() as m:  # the last credit's worker dies after step 1
        m.setattr(shardsteps, "_pay", killed)
        with pytest.raises(Killed):
            await credit_many(core.db, credits[2:])
    pid = credits[0].packet_id
    await core.db.run(
        lambda tx: tx.execute("UPDATE red_packets SET status = 'refunding' WHERE id = %s", (pid,)),
        idempotent=True,
    )
    on_way = await core.db.fetchone(
        "SELECT status FROM grab_records WHERE packet_id = %s AND seq = %s", (pid, credits[2].seq)
    )
    assert on_way is not None and on_way[0] == "crediting"  # the state
    r = await shardsteps.refund(core.db, pid, 1)
    assert r.outcome == "waiting" and (await packets.load_packet(core, pid)).status == "refunding"  # type: ignore[union-attr]
    said = await core.db.fetchone("SELECT COUNT(*) FROM events WHERE idem_key = %s", (f"finished:{pid}",))
    assert said is not None and int(said[0]) == 0  # not told finished while a share is unpaid
    assert await credit_many(core.db, credits[2:]) == ["credited"]
    assert (await shardsteps.refund(core.db, pid, 1)).outcome == "finished"
    assert (await packets.load_packet(core, pid)).status == "finished"  # type: ignore[union-attr]
    said = await core.db.fetchone("SELECT COUNT(*) FROM events WHERE idem_key = %s", (f"finished:{pid}",))
    assert said is not None and int(said[0]) == 1
    assert (await reconcile(core)).ok


@ON_SHARDS
async def test_reconciliation_reports_a_sharded_packet_paid_out_twice(core: Core) -> None:
    """What either refund guard above prevents, made by hand: every share credited and the whole packet
    paid back too. Reconciliation names the packet overpaid, on the sharded ledger as on one database."""
    w = await make_world(core, members=3, admin_cents=10_000)
    credits = await _grabbed(core, w)
    assert await credit_many(core.db, credits) == ["credited"] * 3
    assert (await reconcile(core)).ok
    pid = credits[0].packet_id
    await core.db.run(
        lambda tx: journal.post(tx, w.admin, 900, "refund", f"refund:{pid}", pid), idempotent=True
    )
    assert await _paid_out(core, pid) == 1_800  # the damage
    report = await reconcile(core)
    assert "packet_overpaid" in report.checks(), report
    assert f"packet {pid}" in [d.subject for d in report.differences if d.check == "packet_overpaid"]
