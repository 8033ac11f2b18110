"""The money path on a local Redis Cluster (3 masters, 3 replicas): every script runs there (one slot
each, or Redis refuses it with CROSSSLOT), groups spread over the masters, grabs pay exactly once."""

from __future__ import annotations

import asyncio

from server import bots, events, keys, ledger, packets, settlement
from server.botscore import Decision, Rules
from server.core import Core
from server.reconcile import reconcile
from tests.conftest import make_world
from tests.redisproc import LocalCluster
from tests.test_credit import assert_books_balance, run_worker


async def test_the_shards_spread_over_the_masters(cluster: LocalCluster) -> None:
    owners = {cluster.master_of(keys.credit_outbox(n)).port for n in range(keys.SHARDS)}
    assert len(owners) == cluster.masters
    per_master = [
        sum(cluster.master_of(keys.credit_outbox(n)).port == port for n in range(keys.SHARDS))
        for port in owners
    ]
    assert min(per_master) >= keys.SHARDS // cluster.masters // 2, per_master


async def test_every_operation_of_the_core_runs_on_the_cluster(cluster_core: Core) -> None:
    core = cluster_core
    worlds = [await make_world(core, members=30, admin_cents=100_000) for _ in range(1)]
    w = worlds[0]
    # Several groups, so several shards and masters, each with a packet grabbed by everyone at once.
    from server import groups

    more = []
    for i in range(5):
        g = await groups.create_group(core.db, w.admin, f"g{i}")
        await groups.add_members(core.db, core.membership, g, w.members)
        more.append(g)
    assert len({keys.shard(g) for g in [w.group, *more]}) == 6
    told: dict[tuple[int, int], int] = {}
    for g in [w.group, *more]:
        p = await packets.send_packet(core, w.admin, g, "lucky", 3_000, 30)
        results = await asyncio.gather(*(packets.grab(core, p.packet_id, g, u, gate=True) for u in w.members))
        for r in results:
            told[(p.packet_id, r.grab.user_id)] = r.grab.amount
        again = await packets.grab(core, p.packet_id, g, w.members[0], gate=True)
        assert again.outcome == "already"
        view = await packets.open_packet(core, p.packet_id, g, w.members[0])
        assert (
            view.remaining == 0 and sum(x.amount for x in view.grabs) == 3_000 and view.best_luck is not None
        )
        offset = await events.publish(core, g, "chat", {"user": w.admin, "text": "hi"}, events.Once("t", 60))
        assert (
            await events.publish(core, g, "chat", {"user": w.admin, "text": "hi"}, events.Once("t", 60))
            == offset
        )
        missed = await events.since(core, g, "0-0", 100)
        assert [e[0] for e in missed.events] == [offset]
        await packets.recover_packet(core, p.packet_id)
    assert sum(told.values()) == 6 * 3_000
    assert await run_worker(core) == 6 * 30
    rows = await core.db.fetchall(
        "SELECT packet_id, user_id, amount FROM grab_records WHERE status = 'credited'"
    )
    assert {(int(p), int(u)): int(a) for p, u, a in rows} == told
    # Membership changes, blocks and lifts, refunds: all on the cluster.
    await groups.remove_member(core.db, core.membership, more[0], w.members[0])
    assert not await core.membership.is_member(more[0], w.members[0])
    await bots.apply(
        core, {w.members[1]: Decision(w.members[1], "block", 60, ["test"])}, Rules(), ledger.now_ms()
    )
    assert [b.user for b in await bots.list_blocks(core)] == [w.members[1]]
    assert await bots.lift(core, w.members[1])
    q = await packets.send_packet(core, w.admin, more[1], "lucky", 500, 5)
    await packets.grab(core, q.packet_id, more[1], w.members[2])
    row = await core.db.fetchone("SELECT expires_ms FROM red_packets WHERE id = %s", (q.packet_id,))
    assert row is not None
    refund = await settlement.refund_packet(core, q.packet_id, now=int(row[0]) + 1)
    assert refund.outcome == "refunded"
    assert (await reconcile(core.db)).ok
    await assert_books_balance(core)
