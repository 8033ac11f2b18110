"""Grabs through a Redis crash: durability (a grab is answered "won" only once it is on disk or on a
replica) and the repair of packets after Redis came back with writes missing.

An OS crash is simulated byte-exactly: the server runs under an fsync recorder (``tests/fsyncshim.c``),
is killed with SIGKILL, and each append-only file it appends to is cut back to the last byte it had
fsynced (``RedisProcess.os_crash``) — what a machine that loses power keeps."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
import redis
from redis.asyncio import Redis

from server import errors
from server.core import Core, open_core
from server.durability import Durability
from server.errors import RedPacketError
from server.money import grabs, ledger, packets
from server.money.reconcile import reconcile
from server.store import keys, redisconn, redisnodes
from server.store.batch import NotDurable, durability_problem
from tests.books import assert_books_balance
from tests.conftest import grab_retrying, make_world
from tests.hubtools import eventually, free_port
from tests.redisproc import (
    RedisProcess,
    needs_redis_server,
    online_replicas_only,
    redis_process,
    valkey_server,
)
from worker.drain import CreditDrain


async def on_disk(r: RedisProcess) -> None:
    """Rewrite the server's append-only file and wait (bounded) until the rewrite is done: everything so
    far is in a base file written whole and fsynced, which an OS crash does not touch."""
    client = redis.Redis(port=r.port)
    try:
        before = int(client.info("persistence").get("aof_rewrites", 0))
        client.bgrewriteaof()
        await eventually(lambda: _rewritten(client, before), timeout=60)
    finally:
        client.close()


def _rewritten(client: redis.Redis, before: int) -> bool:
    info = client.info("persistence")
    return int(info.get("aof_rewrites", 0)) > before and not info.get("aof_rewrite_in_progress")


async def paid(core: Core) -> dict[int, tuple[int, int]]:
    """user → (seq, amount) of every credited grab of the packets in the database."""
    rows = await core.db.fetchall("SELECT user_id, seq, amount FROM grab_records WHERE status = 'credited'")
    return {int(u): (int(s), int(a)) for u, s, a in rows}


async def grab_or_none(core: Core, packet_id: int, group: int, user: int) -> grabs.GrabResult | None:
    try:
        return await grabs.grab(core, packet_id=packet_id, group_id=group, user_id=user)
    except RedPacketError as e:
        assert e.code == errors.PACKET_EMPTY, e
        return None


async def grab_the_rest_and_pay(
    c: Core, packet_id: int, group: int, users: list[int], told: dict[int, tuple[int, int]]
) -> dict[int, tuple[int, int]]:
    """Each of ``users`` grabs (those too late are told the packet is empty), a worker pays, and every
    share in ``told`` (theirs added) is paid as told. Returns what the ledger holds, as ``paid``."""
    for u in users:
        g = await grab_or_none(c, packet_id, group, u)
        if g is not None:
            told[u] = (g.grab.seq, g.grab.amount)
    await CreditDrain(c).until_empty()
    held = await paid(c)
    for u, share in told.items():
        assert held.get(u) == share, u
    return held


@needs_redis_server
@pytest.mark.parametrize("core", ["mysql"], indirect=True)
async def test_lost_writes_never_hand_out_a_share_the_database_holds(core: Core, tmp_path: Path) -> None:
    """Durability none, and a server that never fsyncs (``appendfsync no``): an OS crash takes its grabs
    with it after the database paid them. The first grab after the restart checks the packet against the
    database, so nobody is handed those shares again."""
    no_fsync = ("--appendfsync", "no")
    async with redis_process(tmp_path, *no_fsync, fsyncs=tmp_path / "fsyncs") as r:
        s = core.settings.replace(redis_url=r.url, grab_durability="none")
        async with open_core(s) as c:
            w = await make_world(c, members=60, admin_cents=100_000)
            p = await packets.send_packet(
                c, sender_id=w.admin, group_id=w.group, kind="lucky", total=4_000, count=40
            )
            await on_disk(r)  # the packet survives the crash...
            before = {
                u: await grabs.grab(c, packet_id=p.packet_id, group_id=w.group, user_id=u)
                for u in w.members[:20]
            }
            await CreditDrain(c).until_empty()
            assert len(await paid(c)) == 20
            assert await r.os_crash() > 0  # ...its 20 grabs and their credits, never fsynced, do not
            await r.start()
            plain = redis.Redis(port=r.port)
            assert not plain.hlen(keys.packet_grabs(group_id=w.group, packet_id=p.packet_id))  # all gone
            plain.close()

            after = [await grab_or_none(c, p.packet_id, w.group, u) for u in w.members[20:]]
            winners = {g.grab.user_id: (g.grab.seq, g.grab.amount) for g in after if g is not None}
            assert len(winners) == 20  # the 20 shares the database does not hold, and no more
            drain = CreditDrain(c)
            await drain.until_empty()
            assert drain.credited == 20
            held = await paid(c)
            for u, g in before.items():  # paid before the crash: still theirs, answered again as theirs
                assert held[u] == (g.grab.seq, g.grab.amount)
                again = await grabs.grab(c, packet_id=p.packet_id, group_id=w.group, user_id=u)
                assert again.outcome == "already" and again.grab.seq == g.grab.seq
            for u, share in winners.items():  # told after the crash: paid exactly that
                assert held[u] == share
            assert len({seq for seq, _ in held.values()}) == 40 and sum(a for _, a in held.values()) == 4_000
            assert (await reconcile(c)).ok
            await assert_books_balance(c)


@needs_redis_server
@pytest.mark.parametrize("core", ["mysql"], indirect=True)
async def test_a_process_meeting_a_packet_trusts_only_the_server_it_was_loaded_on(
    core: Core, tmp_path: Path
) -> None:
    """A packet's state names the server it was loaded on (``server.store.repair``). A process meeting
    the packet for the first time (a hub started after it was sent, or any hub but the sender's) grabs
    it without the database's check while that server answers; after an OS crash took the packet's paid
    grabs, a process started after it — with nothing in its memory of the crash — checks the packet
    first, and nobody is handed a share the database holds."""
    async with redis_process(tmp_path, "--appendfsync", "no", fsyncs=tmp_path / "fsyncs") as r:
        s = core.settings.replace(redis_url=r.url, grab_durability="none")
        async with open_core(s) as sender:
            w = await make_world(sender, members=15, admin_cents=100_000)
            p = await packets.send_packet(
                sender, sender_id=w.admin, group_id=w.group, kind="lucky", total=1_000, count=10
            )
            await on_disk(r)  # the packet (and its stamp) survives the crash...
        async with open_core(s) as hub:
            first = {
                u: (await grabs.grab(hub, packet_id=p.packet_id, group_id=w.group, user_id=u)).grab
                for u in w.members[:5]
            }
            assert (hub.repairs.trusted, hub.repairs.checks) == (1, 0)  # one Redis read, no database
            await CreditDrain(hub).until_empty()
            assert len(await paid(hub)) == 5
        assert await r.os_crash() > 0  # ...its 5 grabs, paid by the database, never fsynced, do not
        await r.start()
        async with open_core(s) as later:
            after = [await grab_or_none(later, p.packet_id, w.group, u) for u in w.members[5:]]
            assert (later.repairs.trusted, later.repairs.checks) == (0, 1)  # another server: checked
            winners = {g.grab.user_id: (g.grab.seq, g.grab.amount) for g in after if g is not None}
            assert len(winners) == 5  # the 5 shares the database does not hold, and no more
            await CreditDrain(later).until_empty()
            held = await paid(later)
            for u, g in first.items():
                assert held[u] == (g.seq, g.amount)
            assert len({seq for seq, _ in held.values()}) == 10 and sum(a for _, a in held.values()) == 1_000
            assert (await reconcile(later)).ok


@pytest.mark.parametrize("core", ["mysql"], indirect=True)
async def test_with_aof_durability_every_won_survives_an_os_crash(core: Core, tmp_path: Path) -> None:
    """Durability aof (Valkey, ``appendfsync always``, WAITAOF per batch): every grab answered "won" is on
    disk before it is answered. An OS crash mid-storm — the server killed, its append-only file cut back
    to the last byte it fsynced — loses none of them: each is paid as told, no share goes to two users."""
    async with redis_process(
        tmp_path, "--appendfsync", "always", binary=valkey_server(), fsyncs=tmp_path / "fsyncs"
    ) as r:
        s = core.settings.replace(redis_url=r.url, grab_durability="aof")
        async with open_core(s) as c:
            assert await durability_problem(c.redis, "aof") is None
            w = await make_world(c, members=90, admin_cents=100_000)
            p = await packets.send_packet(
                c, sender_id=w.admin, group_id=w.group, kind="lucky", total=6_000, count=60
            )
            told: dict[int, tuple[int, int]] = {}

            async def grab(u: int) -> None:
                g = (await grabs.grab(c, packet_id=p.packet_id, group_id=w.group, user_id=u)).grab
                told[u] = (g.seq, g.amount)

            for u in w.members[:20]:
                await grab(u)
            # A storm, and the machine dies under it: grabs answered, in flight, not yet sent.
            crash_now = asyncio.Event()

            async def chain(users: list[int]) -> None:
                for u in users:
                    try:
                        await grab(u)
                    except RedPacketError as e:
                        assert e.code == errors.REDIS_UNAVAILABLE, e  # the server went away under it
                        return
                    if len(told) >= 25:
                        crash_now.set()

            storm = [asyncio.create_task(chain(w.members[20 + i : 60 : 4])) for i in range(4)]
            await crash_now.wait()
            await r.os_crash()
            await asyncio.gather(*storm)
            assert 25 <= len(told) < 60  # it died mid-storm
            await r.start()
            held = await grab_the_rest_and_pay(c, p.packet_id, w.group, w.members[60:], told)
            seqs = [seq for seq, _ in held.values()]
            assert len(seqs) == len(set(seqs)) and sum(a for _, a in held.values()) <= 6_000
            assert (await reconcile(c)).ok
            await assert_books_balance(c)


@pytest.mark.parametrize(
    ("fsync", "refused"),
    [("always", False), ("everysec", True), ("no", True)],
    ids=["always", "everysec", "no"],
)
async def test_aof_durability_needs_a_server_that_fsyncs_every_write(
    tmp_path: Path, fsync: str, refused: bool
) -> None:
    """With ``everysec``, WAITAOF answers "fsynced" at once while nothing was (measured on Valkey 9.1
    with the fsync recorder; the bug of redis/redis#13793), and with ``no`` it never can: start-up
    refuses both for ``aof``."""
    async with redis_process(tmp_path, "--appendfsync", fsync, binary=valkey_server()) as r:
        client = Redis.from_url(r.url)
        try:
            problem = await durability_problem(client, "aof")
            # A replica is checked the same (it is its master once promoted), without WAITAOF (refused).
            as_replica = await durability_problem(client, "aof+replica", replica=True)
        finally:
            await client.aclose()
    assert (problem is not None) == refused, problem
    assert as_replica == problem
    if refused:
        assert f"appendfsync is {fsync}" in str(problem)


@needs_redis_server
async def test_grabs_are_not_answered_won_when_durability_cannot_be_had(core: Core, tmp_path: Path) -> None:
    """aof on a server without WAITAOF (Redis 7.0) or without its AOF, replica with no replica: the grab
    is made but answered redis_unavailable, never "won"; the retry answers the same share."""
    w = await make_world(core, members=2, admin_cents=10_000)
    p = await packets.send_packet(core, sender_id=w.admin, group_id=w.group, kind="lucky", total=200, count=2)
    for durability in (Durability.AOF, Durability.REPLICA):
        strict = dataclasses.replace(core, settings=core.settings.replace(grab_durability=durability))
        strict.batcher.durability = durability
        try:
            with pytest.raises(RedPacketError) as e:
                await grabs.grab(strict, packet_id=p.packet_id, group_id=w.group, user_id=w.members[0])
            assert e.value.code == errors.REDIS_UNAVAILABLE, e.value
        finally:
            strict.batcher.durability = Durability.NONE
    got = await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=w.members[0])
    assert got.outcome == "already"  # taken the first time; said now
    assert await ledger.balance(core.db, w.members[0]) == 0


def _replica_state(primary: RedisProcess) -> str | None:
    info = redis.Redis(port=primary.port).info("replication")
    return next(
        (v.get("state") for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)), None
    )


@pytest.mark.parametrize("core", ["mysql"], indirect=True)
@pytest.mark.parametrize("guard", ["on", "off"])
async def test_aof_replica_waits_for_any_replica_that_could_take_over_and_goes_on_alone_without_one(
    core: Core, tmp_path: Path, guard: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``aof+replica`` on one server: alone, a grab is answered "won" once fsynced (degraded: the worker's
    gauge says so). A replica connected but still waiting for its full sync could be promoted by a
    Sentinel without the grabs: while it syncs, grabs are not answered "won" (the wait for a replica
    falls short). Once in sync they are; once it is gone, fsynced alone again. Guard off (counting only
    replicas in sync, as before): the grab is answered "won" on the master's disk alone meanwhile."""
    from worker.main import sample
    from worker.metrics import WorkerMetrics

    if guard == "off":
        monkeypatch.setattr(redisnodes, "replicas_to_wait_for", online_replicas_only)
    always = ("--appendfsync", "always")
    # A replica that connects waits a minute in wait_bgsave for its (diskless) full sync to start.
    async with redis_process(
        tmp_path / "primary", *always, "--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "60",
        binary=valkey_server(),
    ) as primary:  # fmt: skip
        s = core.settings.replace(
            redis_url=primary.url, grab_durability="aof+replica", durability_timeout_ms=300
        )
        async with open_core(s) as c:
            metrics = WorkerMetrics()
            address = next(iter(c.nodes.masters()))

            def degraded() -> float:
                return metrics.durability_degraded.labels(address)._value.get()

            w = await make_world(c, members=6, admin_cents=10_000)
            p = await packets.send_packet(
                c, sender_id=w.admin, group_id=w.group, kind="lucky", total=600, count=6
            )
            # (Each grab expected answered is asked as a client asks: again on redis_unavailable. On a
            # loaded machine a first fsync or WAIT may outlast the 300 ms this test allows.)
            await grab_retrying(c, p.packet_id, w.group, w.members[0])
            await sample(c, metrics)
            assert degraded() == 1  # on its disk alone
            async with redis_process(
                tmp_path / "replica", *always, "--replicaof", "127.0.0.1", str(primary.port),
                binary=valkey_server(),
            ) as replica:  # fmt: skip
                await eventually(lambda: _replica_state(primary) == "wait_bgsave", timeout=30)
                await eventually(lambda: c.nodes.look_first(c.nodes.client), timeout=5)
                if guard == "on":
                    with pytest.raises(RedPacketError) as e:
                        await grabs.grab(c, packet_id=p.packet_id, group_id=w.group, user_id=w.members[1])
                    assert e.value.code == errors.REDIS_UNAVAILABLE
                    await sample(c, metrics)
                    assert degraded() == 0
                else:
                    assert (
                        await grabs.grab(c, packet_id=p.packet_id, group_id=w.group, user_id=w.members[1])
                    ).outcome == "won"
                    return
                redis.Redis(port=primary.port).config_set("repl-diskless-sync-delay", 0)
                await eventually(lambda: _replica_state(primary) == "online", timeout=60)
                got, _ = await grab_retrying(c, p.packet_id, w.group, w.members[1])
                assert got.outcome == "already"  # the share its refused grab took
                await grab_retrying(c, p.packet_id, w.group, w.members[2])
                await replica.kill()
                await eventually(lambda: _replica_state(primary) is None, timeout=30)
            # (the batcher's count is at most LOOK_FIRST_AFTER old: a grab sooner waits for the replica gone,
            # is refused, and its retry is answered)
            await eventually(lambda: c.nodes.look_first(c.nodes.client), timeout=5)
            await grab_retrying(c, p.packet_id, w.group, w.members[3])
            await sample(c, metrics)
            assert degraded() == 1


def _replica_online(primary: RedisProcess) -> bool:
    info = redis.Redis(port=primary.port).info("replication")
    return any(
        k.startswith("slave") and isinstance(v, dict) and v.get("state") == "online" for k, v in info.items()
    )


@needs_redis_server
async def test_replica_durability_answers_once_a_replica_has_the_grab(core: Core, tmp_path: Path) -> None:
    async with redis_process(tmp_path / "primary") as primary:
        async with redis_process(tmp_path / "replica", "--replicaof", "127.0.0.1", str(primary.port)):
            await eventually(lambda: _replica_online(primary), timeout=30)
            s = core.settings.replace(redis_url=primary.url, grab_durability="replica")
            async with open_core(s) as c:
                w = await make_world(c, members=20, admin_cents=10_000)
                p = await packets.send_packet(
                    c, sender_id=w.admin, group_id=w.group, kind="lucky", total=2_000, count=20
                )
                got = await asyncio.gather(
                    *(grabs.grab(c, packet_id=p.packet_id, group_id=w.group, user_id=u) for u in w.members)
                )
                assert all(g.outcome == "won" for g in got)
                assert sum(g.grab.amount for g in got) == 2_000


@needs_redis_server
async def test_a_test_server_whose_port_was_taken_meanwhile_starts_on_another(tmp_path: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        r = RedisProcess(tmp_path / "r")
        r.port = taken.getsockname()[1]  # as if something took the port free_port() gave
        await r.start()
        try:
            assert r.port != taken.getsockname()[1] and r.started
            assert await asyncio.to_thread(r._answers)
        finally:
            await r.kill()


async def _follow(replica: RedisProcess, primary: RedisProcess) -> None:
    """Make ``replica`` a replica of ``primary`` and wait (bounded) until it holds primary's data."""
    r = redis.Redis(port=replica.port)
    try:
        r.execute_command("REPLICAOF", "127.0.0.1", str(primary.port))
        await eventually(lambda: _synced(replica, primary), timeout=60)
    finally:
        r.close()


def _synced(replica: RedisProcess, primary: RedisProcess) -> bool:
    info = redis.Redis(port=replica.port).info("replication")
    done = info.get("master_link_status") == "up" and not info.get("master_sync_in_progress")
    return bool(done) and info.get("slave_repl_offset") == redis.Redis(port=primary.port).info(
        "replication"
    ).get("master_repl_offset")


def _detach(server: RedisProcess) -> None:
    redis.Redis(port=server.port).execute_command("REPLICAOF", "NO", "ONE")


@needs_redis_server
@pytest.mark.parametrize("core", ["mysql"], indirect=True)
@pytest.mark.parametrize("guard", ["on", "off"])
async def test_a_failover_back_to_a_server_already_known_is_noticed(
    core: Core, tmp_path: Path, guard: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hub's Redis is demoted to a replica of a server that lags it, takes that server's data (a paid
    grab gone, its share back in the list), and is promoted again: the same process, the same run id, the
    hub's connections open all along. Its role and replication id changed, so the hub checks the packet
    against the database before the next grab: nobody is handed the paid share again. ``off`` is the
    hole — a server known by its run id alone: the share is handed out twice, and reconciliation says
    so."""
    if guard == "off":
        for module in (redisnodes, redisconn):  # (a batcher's look, and a connection's first INFO)
            monkeypatch.setattr(module, "data_id", lambda info: "")
    fast = ("--repl-diskless-sync-delay", "0")
    async with redis_process(tmp_path / "a", *fast) as a, redis_process(tmp_path / "b", *fast) as b:
        async with open_core(core.settings.replace(redis_url=a.url, grab_durability="none")) as c:
            w = await make_world(c, members=4, admin_cents=10_000)
            p = await packets.send_packet(
                c, sender_id=w.admin, group_id=w.group, kind="lucky", total=1_000, count=3
            )
            await _follow(b, a)  # b holds the packet, not yet grabbed
            _detach(b)
            first = (await grabs.grab(c, packet_id=p.packet_id, group_id=w.group, user_id=w.members[0])).grab
            await CreditDrain(c).until_empty()
            assert (await paid(c))[first.user_id] == (first.seq, first.amount)
            generation = c.repairs.generation
            await _follow(a, b)  # a takes b's data: the grab gone, its share back in the list
            _detach(a)
            second = (await grabs.grab(c, packet_id=p.packet_id, group_id=w.group, user_id=w.members[1])).grab
            await CreditDrain(c).until_empty()
            report = await reconcile(c)
            if guard == "off":
                assert c.repairs.generation == generation  # nothing noticed
                assert second.seq == first.seq  # the paid share handed out again
                assert await ledger.balance(c.db, second.user_id) == 0
                assert "credit_refused" in report.checks(), report.differences
                return
            assert c.repairs.generation > generation
            assert second.seq != first.seq
            again = await grabs.grab(c, packet_id=p.packet_id, group_id=w.group, user_id=first.user_id)
            assert again.outcome == "already" and again.grab == first
            assert await ledger.balance(c.db, second.user_id) == second.amount
            assert report.ok, report.differences


@needs_redis_server
@pytest.mark.parametrize("core", ["mysql"], indirect=True)
async def test_with_replica_durability_every_won_survives_a_failover_to_a_lagging_replica(
    core: Core, tmp_path: Path
) -> None:
    """The replica loses its link to the master (a network partition: it is pointed at a port where
    nothing listens, keeping its data); grabs go on, the master dies, the lagging replica is promoted.
    Grabs made while it lagged were never answered "won" (no replica had them: the wait fell short,
    ``redis_unavailable``), so none that was told is lost: every "won" is paid as told from the promoted
    replica's data, and what it lacks was told to nobody."""
    async with redis_process(tmp_path / "primary") as primary:
        async with redis_process(
            tmp_path / "replica", "--replicaof", "127.0.0.1", str(primary.port)
        ) as replica:
            await eventually(lambda: _replica_online(primary), timeout=30)
            s = core.settings.replace(
                redis_url=primary.url, grab_durability="replica", durability_timeout_ms=300
            )
            told: dict[int, tuple[int, int]] = {}
            unanswered: list[int] = []
            async with open_core(s) as c:
                w = await make_world(c, members=40, admin_cents=10_000)
                p = await packets.send_packet(
                    c, sender_id=w.admin, group_id=w.group, kind="lucky", total=3_000, count=30
                )
                for u in w.members[:10]:  # (asked again on redis_unavailable, as a client does)
                    g = (await grab_retrying(c, p.packet_id, w.group, u))[0].grab
                    told[u] = (g.seq, g.amount)
                await _follow_done(replica, primary)
                partitioned = redis.Redis(port=replica.port)
                partitioned.execute_command("REPLICAOF", "127.0.0.1", str(free_port()))
                partitioned.close()
                await eventually(lambda: not _replica_online(primary), timeout=30)
                try:
                    for u in w.members[10:20]:  # executed on the master, never confirmed by a replica
                        with pytest.raises(RedPacketError) as e:
                            await grabs.grab(c, packet_id=p.packet_id, group_id=w.group, user_id=u)
                        assert e.value.code == errors.REDIS_UNAVAILABLE
                        unanswered.append(u)
                    # A worker pays only what is durable: its read of the credits waits like a grab.
                    with pytest.raises(NotDurable):
                        await CreditDrain(c).until_empty()
                    assert await paid(c) == {}
                finally:
                    await primary.kill()
            _detach(replica)  # the failover: the lagging replica is the master now
            async with open_core(s.replace(redis_url=replica.url, grab_durability="none")) as c:
                held = await grab_the_rest_and_pay(c, p.packet_id, w.group, w.members[20:], told)
                assert not set(unanswered) & set(held)  # lost with the master: told nothing, paid nothing
                assert len(told) == 30 and sum(a for _, a in held.values()) == 3_000
                assert (await reconcile(c)).ok
                await assert_books_balance(c)


async def _follow_done(replica: RedisProcess, primary: RedisProcess) -> None:
    await eventually(lambda: _synced(replica, primary), timeout=60)
