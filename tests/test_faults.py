"""Faults with real processes: a worker killed mid-batch, a database connection killed mid-transaction,
Redis killed (kill -9, AOF on) and restarted in the middle of a grab storm. Each ends with zero
reconciliation difference, no double credit and no lost grab."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pymysql
import pytest
import redis

from server.core import Core, open_core
from server.money import grabs, ledger, packets
from server.money.crediting import credit_many
from server.money.reconcile import reconcile
from server.store import keys
from server.store.records import CreditEntry
from tests.books import assert_books_balance, credited_is, run_worker, side_session
from tests.conftest import make_world, redis_pings
from tests.hubtools import eventually, worker_env
from tests.redisproc import needs_redis_server, redis_process
from worker.drain import CreditDrain


async def _paid(core: Core) -> tuple[int, int, int]:
    row = await core.db.fetchone(
        "SELECT COUNT(*), COUNT(DISTINCT packet_id, seq), COALESCE(SUM(amount), 0) FROM grab_records"
        " WHERE status = 'credited'"
    )
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


async def _storm(core: Core, members: int) -> tuple[int, list[int], list[CreditEntry]]:
    """A world, ten 100-share packets, and every member grabbing every packet (the credits queued)."""
    w = await make_world(core, members=members, admin_cents=1_000_000)
    credits: list[CreditEntry] = []
    for _ in range(10):
        p = await packets.send_packet(
            core, sender_id=w.admin, group_id=w.group, kind="lucky", total=10_000, count=members
        )
        results = await asyncio.gather(
            *(grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=u) for u in w.members)
        )
        credits += [
            CreditEntry(p.packet_id, r.grab.user_id, r.grab.seq, r.grab.amount, r.grab.grabbed_ms)
            for r in results
        ]
    return w.group, w.members, credits


@pytest.mark.parametrize("core", ["mysql"], indirect=True)
async def test_a_worker_killed_mid_batch_then_a_new_worker_finishes(core: Core) -> None:
    """The worker is held mid-batch, not raced: a payment it must make waits on a grabber's account row
    the test holds locked, while it holds claims on outbox entries it read; it is killed there (it had
    finished before the kill once, on a loaded machine)."""
    _, grabbers, credits = await _storm(core, 100)
    env = worker_env(core.settings)
    with _held_payment(core, grabbers[0]):
        worker = subprocess.Popen(  # noqa: ASYNC220 - one process per test
            [sys.executable, "-m", "server", "worker"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            await eventually(lambda: _claimed(core), timeout=60)  # read, claimed, its payment held
        finally:
            worker.send_signal(signal.SIGKILL)
            await asyncio.to_thread(worker.wait, 30)
    killed_at = time.monotonic()
    paid_at_kill = (await _paid(core))[0]
    assert paid_at_kill < len(credits), "the worker finished before it could be killed"
    # Another worker's drain (no sweeper here: only the drain) takes the dead one's claims over as their
    # short leases lapse, with nothing expired or restarted by hand.
    successor = CreditDrain(core)
    await eventually(lambda: _all_paid(core, successor, len(credits)), timeout=60)
    print(f"the dead worker's credits were all paid {time.monotonic() - killed_at:.1f} s after the kill")
    count, distinct, amount = await _paid(core)
    assert count == distinct == len(credits)
    assert amount == sum(c.amount for c in credits) == 100_000
    assert (await reconcile(core)).ok
    await assert_books_balance(core)


async def _claimed(core: Core) -> bool:
    """Whether a worker holds outbox entries it read and has not acknowledged (paid) yet."""
    for n in range(keys.SHARDS):
        with contextlib.suppress(redis.ResponseError):  # no consumer group on that shard yet
            summary = await core.redis.xpending(keys.credit_outbox(n), keys.CREDIT_GROUP)
            if summary["pending"]:
                return True
    return False


@contextlib.contextmanager
def _held_payment(core: Core, user: int) -> Iterator[None]:
    """While inside, no payment to ``user`` can commit: their account row is locked by a MariaDB
    connection of the test's own."""
    conn = side_session(core.settings.database_url, autocommit=False)
    try:
        conn.cursor().execute("SELECT balance FROM accounts WHERE user_id = %s FOR UPDATE", (user,))
        yield
    finally:
        conn.rollback()
        conn.close()


async def _all_paid(core: Core, drain: CreditDrain, n: int) -> bool:
    await drain.until_empty()
    return (await _paid(core))[0] == n


@pytest.mark.parametrize("core", ["mysql"], indirect=True)
async def test_a_database_connection_killed_mid_transaction(core: Core) -> None:
    """A crediting transaction's connection killed after it wrote its rows and before it committed (held
    there on purpose), then connections killed at random under the rest of the crediting: every call
    that returns says "credited" or "already", each grab is paid once, each balance is its credits."""
    _, _, credits = await _storm(core, 50)
    db_name = core.settings.database_url.rsplit("/", 1)[1]
    runs_again = sum(core.db.health.retries.values())  # Database.run counts each time it runs again
    raised: list[Exception] = []

    async def credit(batch: list[CreditEntry], first_try: asyncio.Task[list[str]] | None = None) -> None:
        """Credit ``batch`` as the worker's caller does: again while it fails (20 tries)."""
        for _ in range(20):
            try:
                outcomes = await (first_try or credit_many(core.db, batch))
            except Exception as e:  # the database away, or a lost COMMIT answer that the retries outlived
                raised.append(e)
                first_try = None
                continue
            assert len(outcomes) == len(batch) and set(outcomes) <= {"credited", "already"}, outcomes
            return
        raise AssertionError(f"a batch was never credited: {raised[-3:]}")

    def connect() -> Any:
        # No default database: the random killer below kills only connections to ours.
        return side_session(core.settings.database_url, in_database=False)

    # 1. One account of the first batch held locked: its transaction writes its grab records and journal
    #    rows, then waits at the balances. Its connection is killed there.
    first = credits[:25]
    holder, look = await asyncio.to_thread(connect), await asyncio.to_thread(connect)
    try:
        await asyncio.to_thread(
            holder.cursor().execute,
            f"SELECT balance FROM `{db_name}`.accounts WHERE user_id = %s FOR UPDATE",
            (first[0].user_id,),
        )
        attempt = asyncio.create_task(credit_many(core.db, first))

        def at_the_balances() -> tuple[int, int] | None:
            """(thread, journal rows it wrote, uncommitted) of a transaction on our database waiting at
            the balances' UPDATE. (The processlist, not innodb_trx: InnoDB refreshes that only when it
            has not been read for 0.1 s.)"""
            with look.cursor() as cur:
                cur.execute(
                    "SELECT id FROM information_schema.processlist WHERE db = %s AND info LIKE %s",
                    (db_name, "UPDATE accounts SET balance%"),
                )
                row = cur.fetchone()
                if row is None:
                    return None
                cur.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ UNCOMMITTED")
                cur.execute(
                    f"SELECT COUNT(*) FROM `{db_name}`.journal WHERE kind = 'grab' AND packet_id = %s",
                    (first[0].packet_id,),
                )
                written = cur.fetchone()
                look.rollback()
            return int(row[0]), int(written[0])

        async def waiting() -> bool:
            return await asyncio.to_thread(at_the_balances) is not None

        await eventually(waiting, 30)
        victim = await asyncio.to_thread(at_the_balances)
        assert victim is not None and victim[1] == len(first), victim  # written, not committed
        assert (await _paid(core))[0] == 0
        await asyncio.to_thread(look.cursor().execute, f"KILL {victim[0]}")
    finally:
        await asyncio.to_thread(holder.rollback)
        holder.close()
        look.close()
    await credit(first, attempt)
    # Killed mid-transaction, the call was run again by ``Database.run`` or failed to its caller.
    retried = sum(core.db.health.retries.values()) > runs_again
    assert retried or raised, "the killed transaction was neither run again nor failed"
    assert (await _paid(core))[0] == len(first)

    # 2. The rest, with a connection of our database killed every few milliseconds.
    killer_stop = asyncio.Event()

    def kill_one() -> int:
        conn = side_session(core.settings.database_url, autocommit=True)
        try:
            with conn.cursor() as cur:
                cur.execute(
                    "SELECT id FROM information_schema.processlist WHERE db = %s AND id <> CONNECTION_ID()",
                    (db_name,),
                )
                ids = [r[0] for r in cur.fetchall()]
                for i in ids[:1]:
                    with contextlib.suppress(pymysql.err.OperationalError):
                        cur.execute(f"KILL {int(i)}")
                return len(ids[:1])
        finally:
            conn.close()

    async def killer() -> int:
        kills = 0
        while not killer_stop.is_set():
            kills += await asyncio.to_thread(kill_one)
            await asyncio.sleep(0.005)
        return kills

    k = asyncio.create_task(killer())
    try:
        for i in range(len(first), len(credits), 25):
            await credit(credits[i : i + 25])
    finally:
        killer_stop.set()
        kills = await k
    # Connections were killed under this crediting. Whether one was in a transaction then is chance
    # (most are idle in the pool between batches): the kill that surely was is the one above.
    assert kills > 0
    # Whatever was cut, crediting everything once more pays nothing twice.
    again = await credit_many(core.db, credits)
    assert set(again) == {"already"}
    count, distinct, amount = await _paid(core)
    assert count == distinct == len(credits) and amount == sum(c.amount for c in credits)
    owed: dict[int, int] = {}
    for c in credits:
        owed[c.user_id] = owed.get(c.user_id, 0) + c.amount
    for user, amount in owed.items():
        assert await ledger.balance(core.db, user) == amount
    assert (await reconcile(core)).ok
    await assert_books_balance(core)


@needs_redis_server
async def test_redis_restarted_with_aof_in_a_grab_storm(core: Core, tmp_path: Path) -> None:
    """kill -9 of Redis (AOF on, durability ``none``) while grabs are in it and not answered yet: what
    Redis wrote to the OS survives a kill of the process, so every grab answered "won" is paid as told,
    and a grab made but not answered is answered the same share on its retry.

    ``appendfsync no``: Redis then writes the AOF before every reply. With ``everysec`` it may hold the
    write back up to 2 s while a slow fsync runs and answer meanwhile (its documented window): on a
    loaded machine a kill then lost a grab already answered, and its grabber got another share — which is
    why durability ``aof`` waits for the fsync (``WAITAOF``) before a "won"."""
    async with redis_process(tmp_path, "--appendfsync", "no") as r:
        s = core.settings.replace(redis_url=r.url)
        async with open_core(s) as c:
            w = await make_world(c, members=60, admin_cents=100_000)
            p = await packets.send_packet(
                c, sender_id=w.admin, group_id=w.group, kind="lucky", total=6_000, count=60
            )
            grabs_key = keys.packet_grabs(group_id=w.group, packet_id=p.packet_id)
            told: dict[int, tuple[int, int]] = {}  # user → (seq, amount) answered: won, or already

            async def grab(u: int) -> None:
                # A client: retried while Redis is away (until it is back, or 30 s).
                for _ in range(600):
                    try:
                        g = (await grabs.grab(c, packet_id=p.packet_id, group_id=w.group, user_id=u)).grab
                        told[u] = (g.seq, g.amount)
                        return
                    except Exception:
                        await asyncio.sleep(0.05)

            # Every grabber at once, in ten lanes of six one after another: the grabs of one loop tick
            # go to Redis as one pipeline, so sixty started at once could be answered all together; the
            # lanes make the answers come ten at a time. ``enough`` is set by the grab that makes 20.
            enough = asyncio.Event()

            async def lane(users: list[int]) -> None:
                for u in users:
                    await grab(u)
                    if len(told) >= 20:
                        enough.set()

            storm = asyncio.gather(*(lane(w.members[i::10]) for i in range(10)))
            await asyncio.wait_for(enough.wait(), 60)
            # kill -9 as soon as Redis holds grabs no grabber has been told about. The look is a blocking
            # client, between single turns of this loop: the answers of the grabs it sees have not
            # reached their grabbers yet when it looks (that takes the loop more than one turn), and
            # nothing runs from the look to the kill.
            look = redis.Redis(port=r.port)
            try:
                deadline = time.monotonic() + 30
                while len(in_redis := _records(look.hgetall(grabs_key))) <= len(told):
                    assert time.monotonic() < deadline, "no grab reached Redis"
                    await asyncio.sleep(0)  # one turn of the loop: the storm goes on
                told_at_kill = dict(told)
                await r.kill()
            finally:
                look.close()
            assert 20 <= len(told_at_kill) < 60 and told_at_kill.items() < in_redis.items()
            await r.start()
            await storm
            # Every grab Redis had made by the kill, answered or not, is the grabber's share after it.
            assert len(told) == 60 and in_redis.items() <= told.items()
            # Repeats after the restart answer the same share.
            for u in w.members:
                again = (await grabs.grab(c, packet_id=p.packet_id, group_id=w.group, user_id=u)).grab
                assert (again.seq, again.amount) == told[u]
            await run_worker(c)
            rows = await c.db.fetchall(
                "SELECT user_id, seq, amount FROM grab_records WHERE packet_id = %s AND status = 'credited'",
                (p.packet_id,),
            )
            assert {int(u): (int(q), int(a)) for u, q, a in rows} == told  # every "won" paid, as told
            for u in w.members:
                assert await ledger.balance(c.db, u) == told[u][1]
            assert sum(a for _, a in told.values()) == 6_000
            assert (await reconcile(c)).ok
            await assert_books_balance(c)


def _records(held: dict[bytes, bytes]) -> dict[int, tuple[int, int]]:
    """user → (seq, amount) of a packet's grabs hash."""
    return {int(u): (int(v.split(b":")[0]), int(v.split(b":")[1])) for u, v in held.items()}


@needs_redis_server
@pytest.mark.parametrize("core", ["mysql"], indirect=True)
async def test_redis_killed_and_restarted_under_two_workers_that_ride_it_out(
    core: Core, tmp_path: Path
) -> None:
    """kill -9 of Redis while two ``redpacket worker`` processes run: neither exits, both resume on their
    own, and every grab made before and after is credited once. No process is restarted by the test."""
    async with redis_process(tmp_path) as r:
        s = core.settings.replace(redis_url=r.url)
        env = worker_env(s)
        logs = [tmp_path / f"worker{i}.log" for i in range(2)]
        outputs = [log.open("w") for log in logs]
        workers = [
            subprocess.Popen(  # noqa: ASYNC220 - the two workers under test
                [sys.executable, "-m", "server", "worker"], env=env, stdout=out, stderr=subprocess.STDOUT
            )
            for out in outputs
        ]
        try:
            for log in logs:  # both started (a worker that cannot reach Redis at start-up exits: wrong URL)
                await eventually(lambda log=log: "worker running" in log.read_text(), timeout=60)  # type: ignore[misc]
            async with open_core(s) as c:
                w = await make_world(c, members=40, admin_cents=100_000)
                told: dict[tuple[int, int], int] = {}
                before = await packets.send_packet(
                    c, sender_id=w.admin, group_id=w.group, kind="lucky", total=4_000, count=40
                )
                for u in w.members:
                    told[(before.packet_id, u)] = (
                        await grabs.grab(c, packet_id=before.packet_id, group_id=w.group, user_id=u)
                    ).grab.amount
                await r.kill()
                # Both workers notice (their loops fail) and keep running.
                for log in logs:
                    await eventually(lambda log=log: "starting it again" in log.read_text(), timeout=60)  # type: ignore[misc]
                assert all(wk.poll() is None for wk in workers)
                await r.start()
                await eventually(lambda: redis_pings(c), timeout=30)
                after = await _retrying_send(c, w.admin, w.group)
                for u in w.members:
                    told[(after.packet_id, u)] = (
                        await grabs.grab(c, packet_id=after.packet_id, group_id=w.group, user_id=u)
                    ).grab.amount
                await eventually(lambda: credited_is(c.db, len(told)), timeout=120)
                rows = await c.db.fetchall(
                    "SELECT packet_id, user_id, amount FROM grab_records WHERE status = 'credited'"
                )
                assert {(int(p), int(u)): int(a) for p, u, a in rows} == told
                assert sum(told.values()) == 8_000
                assert (await reconcile(c)).ok
                await assert_books_balance(c)
            assert all(wk.poll() is None for wk in workers), [log.read_text()[-2000:] for log in logs]
        finally:
            for wk in workers:
                wk.terminate()
                await asyncio.to_thread(wk.wait, 30)
            for out in outputs:
                out.close()


async def _retrying_send(c: Core, admin: int, group: int) -> packets.Packet:
    from server.errors import Unavailable

    for _ in range(100):
        try:
            return await packets.send_packet(
                c, sender_id=admin, group_id=group, kind="lucky", total=4_000, count=40
            )
        except Unavailable:
            await asyncio.sleep(0.1)
    raise AssertionError("Redis did not come back for sends")
