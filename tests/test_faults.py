"""Faults with real processes: a worker killed mid-batch, a database connection killed mid-transaction,
Redis restarted (AOF on) in the middle of a grab storm. Each ends with zero reconciliation difference,
no double credit and no lost grab."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import time
from pathlib import Path

import pymysql
import pytest

from server.core import Core, open_core
from server.money import grabs, ledger, packets
from server.money.crediting import credit_many
from server.money.ledger import Credit
from server.money.reconcile import reconcile
from tests.conftest import make_world
from tests.hubtools import eventually, worker_env
from tests.redisproc import needs_redis_server, redis_process
from tests.test_credit import assert_books_balance, run_worker
from worker.drain import CreditDrain


async def _paid(core: Core) -> tuple[int, int, int]:
    row = await core.db.fetchone(
        "SELECT COUNT(*), COUNT(DISTINCT packet_id, seq), COALESCE(SUM(amount), 0) FROM grab_records"
        " WHERE status = 'credited'"
    )
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


async def _storm(core: Core, members: int) -> tuple[int, list[int], list[Credit]]:
    """A world, ten 100-share packets, and every member grabbing every packet (the credits queued)."""
    w = await make_world(core, members=members, admin_cents=1_000_000)
    credits: list[Credit] = []
    for _ in range(10):
        p = await packets.send_packet(core, w.admin, w.group, "lucky", 10_000, members)
        results = await asyncio.gather(*(grabs.grab(core, p.packet_id, w.group, u) for u in w.members))
        credits += [
            Credit(p.packet_id, r.grab.user_id, r.grab.seq, r.grab.amount, r.grab.grabbed_ms) for r in results
        ]
    return w.group, w.members, credits


@pytest.mark.parametrize("core", ["mysql"], indirect=True)
async def test_a_worker_killed_mid_batch_then_a_new_worker_finishes(core: Core) -> None:
    _, _, credits = await _storm(core, 100)
    env = worker_env(core.settings)
    worker = subprocess.Popen(  # noqa: ASYNC220 - one process per test
        [sys.executable, "-m", "server", "worker"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        await eventually(lambda: _some_paid(core), timeout=60)
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
    assert (await reconcile(core.db)).ok
    await assert_books_balance(core)


async def _some_paid(core: Core) -> bool:
    return (await _paid(core))[0] > 0


async def _all_paid(core: Core, drain: CreditDrain, n: int) -> bool:
    await drain.until_empty()
    return (await _paid(core))[0] == n


@pytest.mark.parametrize("core", ["mysql"], indirect=True)
async def test_a_database_connection_killed_mid_transaction(core: Core) -> None:
    _, _, credits = await _storm(core, 50)
    killer_stop = asyncio.Event()
    url = core.settings.database_url
    db_name = url.rsplit("/", 1)[1]

    def kill_one() -> int:
        conn = pymysql.connect(host="127.0.0.1", user="root", database=db_name)
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
    outcomes: list[str] = []
    for i in range(0, len(credits), 25):
        batch = credits[i : i + 25]
        for _ in range(20):  # a caller (arq) retries what failed
            try:
                outcomes += await credit_many(core.db, batch)
                break
            except Exception:
                continue
    killer_stop.set()
    kills = await k
    assert kills > 0
    # Whatever was cut, crediting everything once more pays nothing twice.
    again = await credit_many(core.db, credits)
    assert set(again) <= {"credited", "already"}
    count, distinct, amount = await _paid(core)
    assert count == distinct == len(credits) and amount == sum(c.amount for c in credits)
    assert (await reconcile(core.db)).ok
    await assert_books_balance(core)


@needs_redis_server
async def test_redis_restarted_with_aof_in_a_grab_storm(core: Core, tmp_path: Path) -> None:
    async with redis_process(tmp_path) as r:
        s = core.settings.with_(redis_url=r.url)
        async with open_core(s) as c:
            w = await make_world(c, members=60, admin_cents=100_000)
            p = await packets.send_packet(c, w.admin, w.group, "lucky", 6_000, 60)
            told: dict[int, int] = {}

            async def grab(u: int) -> None:
                for _ in range(100):
                    try:
                        told[u] = (await grabs.grab(c, p.packet_id, w.group, u)).grab.amount
                        return
                    except Exception:
                        await asyncio.sleep(0.05)

            await asyncio.gather(*(grab(u) for u in w.members[:30]))
            # A clean restart: Redis writes its append-only file and comes back with every grab.
            await c.redis.shutdown(nosave=False)
            assert r.proc is not None
            await asyncio.to_thread(r.proc.wait, 30)
            await r.start()
            await asyncio.gather(*(grab(u) for u in w.members[30:]))
            # Repeats after the restart answer the same share.
            for u in w.members[:30]:
                assert (await grabs.grab(c, p.packet_id, w.group, u)).grab.amount == told[u]
            await run_worker(c)
            for u in w.members:
                assert await ledger.balance(c.db, u) == told[u]
            assert sum(told.values()) == 6_000
            assert (await reconcile(c.db)).ok


async def _pings(c: Core) -> bool:
    try:
        return bool(await c.redis.ping())
    except Exception:
        return False


@needs_redis_server
@pytest.mark.parametrize("core", ["mysql"], indirect=True)
async def test_redis_killed_and_restarted_under_two_workers_that_ride_it_out(
    core: Core, tmp_path: Path
) -> None:
    """kill -9 of Redis while two ``redpacket worker`` processes run: neither exits, both resume on their
    own, and every grab made before and after is credited once. No process is restarted by the test."""
    async with redis_process(tmp_path) as r:
        s = core.settings.with_(redis_url=r.url)
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
                before = await packets.send_packet(c, w.admin, w.group, "lucky", 4_000, 40)
                for u in w.members:
                    told[(before.packet_id, u)] = (
                        await grabs.grab(c, before.packet_id, w.group, u)
                    ).grab.amount
                await r.kill()
                # Both workers notice (their loops fail) and keep running.
                for log in logs:
                    await eventually(lambda log=log: "starting it again" in log.read_text(), timeout=60)  # type: ignore[misc]
                assert all(wk.poll() is None for wk in workers)
                await r.start()
                await eventually(lambda: _pings(c), timeout=30)
                after = await _retrying_send(c, w.admin, w.group)
                for u in w.members:
                    told[(after.packet_id, u)] = (
                        await grabs.grab(c, after.packet_id, w.group, u)
                    ).grab.amount
                await eventually(lambda: _credited(c, len(told)), timeout=120)
                rows = await c.db.fetchall(
                    "SELECT packet_id, user_id, amount FROM grab_records WHERE status = 'credited'"
                )
                assert {(int(p), int(u)): int(a) for p, u, a in rows} == told
                assert sum(told.values()) == 8_000
                assert (await reconcile(c.db)).ok
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
            return await packets.send_packet(c, admin, group, "lucky", 4_000, 40)
        except Unavailable:
            await asyncio.sleep(0.1)
    raise AssertionError("Redis did not come back for sends")


async def _credited(c: Core, n: int) -> bool:
    row = await c.db.fetchone("SELECT COUNT(*) FROM grab_records WHERE status = 'credited'")
    return row is not None and int(row[0]) == n
