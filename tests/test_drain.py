"""The bulk credit drain: hundreds of queued credit jobs per batch, finished as arq would finish them."""

from __future__ import annotations

import asyncio

from server import keys, ledger, packets
from server.core import Core
from server.reconcile import reconcile
from tests.conftest import make_world
from tests.test_credit import assert_books_balance, run_worker
from worker.drain import CreditDrain


async def _storm(core: Core, members: int) -> dict[int, int]:
    w = await make_world(core, members=members, admin_cents=100_000)
    p = await packets.send_packet(core, w.admin, w.group, "lucky", members * 100, members)
    results = await asyncio.gather(*(packets.grab(core, p.packet_id, w.group, u) for u in w.members))
    return {r.grab.user_id: r.grab.amount for r in results}


async def test_the_drain_pays_a_storm_in_big_batches(core: Core) -> None:
    told = await _storm(core, 100)
    drain = CreditDrain(core, batch=60)
    assert await drain.until_empty() == 100
    assert sum(b.get() for b in drain.metrics.batch_size._buckets) == 2  # 60 + 40
    for user, amount in told.items():
        assert await ledger.balance(core.db, user) == amount
    assert await core.redis.zcard(core.settings.queue_name) == 0
    # Finished like arq: the job is gone, its result kept, so enqueueing the grab again is a no-op.
    pid = int((await core.db.fetchone("SELECT MAX(id) FROM red_packets"))[0])  # type: ignore[index]
    assert await core.redis.exists(keys.credit_job_key(pid, 1)) == 0
    assert await core.redis.exists(keys.credit_result_key(pid, 1)) == 1
    assert await run_worker(core) == 0
    assert (await reconcile(core.db)).ok
    await assert_books_balance(core)


async def test_the_drain_and_arq_share_a_queue_without_running_a_job_twice(core: Core) -> None:
    told = await _storm(core, 80)
    drain = CreditDrain(core, batch=20)
    ran = await asyncio.gather(drain.until_empty(), run_worker(core))
    assert ran[0] + ran[1] == 80  # every job ran once, by one of them
    for user, amount in told.items():
        assert await ledger.balance(core.db, user) == amount
    rows = await core.db.fetchone("SELECT COUNT(*) FROM journal WHERE kind = 'grab'")
    assert rows is not None and int(rows[0]) == 80
    assert (await reconcile(core.db)).ok


async def test_a_drain_that_died_mid_batch_leaves_jobs_that_run_again(core: Core) -> None:
    from arq.constants import in_progress_key_prefix

    told = await _storm(core, 30)
    # A drain claimed every job and died before paying: its claims outlive it until they expire.
    ids = await core.redis.zrange(core.settings.queue_name, 0, -1)
    for job_id in ids:
        await core.redis.set(in_progress_key_prefix + job_id.decode(), b"drain", px=60_000)
    assert await CreditDrain(core).until_empty() == 0
    await core.redis.delete(*[in_progress_key_prefix + i.decode() for i in ids])  # the claims expire
    assert await CreditDrain(core).until_empty() == 30
    assert sum([await ledger.balance(core.db, u) for u in told]) == sum(told.values())


async def test_the_drain_steps_over_jobs_held_elsewhere_and_leaves_other_jobs_alone(core: Core) -> None:
    from arq.constants import in_progress_key_prefix

    told = await _storm(core, 40)
    queue = core.settings.queue_name
    # Another kind of job, due first, and the first half of the credits held by another worker.
    other = await core.redis.enqueue_job("refund_packet", 1, _job_id="refund:1", _queue_name=queue)
    assert other is not None
    ids = [i.decode() for i in await core.redis.zrange(queue, 0, -1) if i.startswith(b"credit:")]
    held = ids[:20]
    for job_id in held:
        await core.redis.set(in_progress_key_prefix + job_id, b"other", px=60_000)
    drain = CreditDrain(core, batch=7)
    assert await drain.until_empty() == 20
    left = {i.decode() for i in await core.redis.zrange(queue, 0, -1)}
    assert left == {"refund:1", *held}
    paid = {u for u in told if await ledger.balance(core.db, u) > 0}
    assert len(paid) == 20
    # The other worker's claims lapse: the rest is paid, once.
    await core.redis.delete(*[in_progress_key_prefix + j for j in held])
    assert await CreditDrain(core).until_empty() == 20
    assert sum([await ledger.balance(core.db, u) for u in told]) == sum(told.values())
    assert {i.decode() for i in await core.redis.zrange(queue, 0, -1)} == {"refund:1"}
    await core.redis.delete(queue)
