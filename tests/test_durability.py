"""Grabs through a Redis crash: durability (a grab is answered "won" only once it is on disk or on a
replica) and the repair of packets after Redis came back with writes missing.

An OS crash is simulated as the issue's fault storm did it: kill -9, then the append-only file cut back to
a whole second (``redis-check-aof --truncate-to-timestamp``, with ``aof-timestamp-enabled``)."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import subprocess
import time
from pathlib import Path

import pytest
import redis

from server import errors
from server.core import Core, open_core
from server.errors import RedPacketError
from server.money import grabs, ledger, packets
from server.money.reconcile import reconcile
from tests.conftest import make_world
from tests.hubtools import eventually
from tests.redisproc import RedisProcess, needs_redis_server, redis_process, valkey_server
from tests.test_credit import assert_books_balance
from worker.drain import CreditDrain

TIMESTAMPED = ("--aof-timestamp-enabled", "yes", "--aof-use-rdb-preamble", "no")


async def crash(r: RedisProcess, keep_until: int) -> None:
    """kill -9, then lose every write made after the whole second ``keep_until`` (unix s), as an OS
    crash loses what was not on disk; then start the server again on what is left."""
    await r.kill()
    manifest = r.dir / "appendonlydir" / "appendonly.aof.manifest"
    done = await asyncio.to_thread(
        subprocess.run,
        ["redis-check-aof", "--truncate-to-timestamp", str(keep_until), str(manifest)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    await r.start()


async def next_second() -> int:
    """Wait for the clock's next whole second (at most one): writes made after it can be cut alone.
    Returns the second that ended."""
    now = time.time()
    await asyncio.sleep(math.floor(now) + 1.01 - now)
    return math.floor(now)


async def paid(core: Core) -> dict[int, tuple[int, int]]:
    """user → (seq, amount) of every credited grab of the packets in the database."""
    rows = await core.db.fetchall("SELECT user_id, seq, amount FROM grab_records WHERE status = 'credited'")
    return {int(u): (int(s), int(a)) for u, s, a in rows}


async def grab_or_none(core: Core, packet_id: int, group: int, user: int) -> grabs.GrabResult | None:
    try:
        return await grabs.grab(core, packet_id, group, user)
    except RedPacketError as e:
        assert e.code == errors.PACKET_EMPTY, e
        return None


@needs_redis_server
@pytest.mark.parametrize("core", ["mysql"], indirect=True)
async def test_lost_writes_never_hand_out_a_share_the_database_holds(core: Core, tmp_path: Path) -> None:
    """Durability none: Redis comes back without grabs the database already paid. The first grab after
    the restart checks the packet against the database, so nobody is handed those shares again."""
    async with redis_process(tmp_path, *TIMESTAMPED) as r:
        s = core.settings.with_(redis_url=r.url, grab_durability="none")
        async with open_core(s) as c:
            w = await make_world(c, members=60, admin_cents=100_000)
            p = await packets.send_packet(c, w.admin, w.group, "lucky", 4_000, 40)
            sent_by = await next_second()
            before = {u: await grabs.grab(c, p.packet_id, w.group, u) for u in w.members[:20]}
            await CreditDrain(c).until_empty()
            assert len(await paid(c)) == 20
            await crash(r, keep_until=sent_by)  # the packet survives, its 20 grabs and their credits do not

            after = [await grab_or_none(c, p.packet_id, w.group, u) for u in w.members[20:]]
            winners = {g.grab.user_id: (g.grab.seq, g.grab.amount) for g in after if g is not None}
            assert len(winners) == 20  # the 20 shares the database does not hold, and no more
            drain = CreditDrain(c)
            await drain.until_empty()
            assert drain.credited == 20
            held = await paid(c)
            for u, g in before.items():  # paid before the crash: still theirs, answered again as theirs
                assert held[u] == (g.grab.seq, g.grab.amount)
                again = await grabs.grab(c, p.packet_id, w.group, u)
                assert again.outcome == "already" and again.grab.seq == g.grab.seq
            for u, share in winners.items():  # told after the crash: paid exactly that
                assert held[u] == share
            assert len({seq for seq, _ in held.values()}) == 40 and sum(a for _, a in held.values()) == 4_000
            assert (await reconcile(c.db)).ok
            await assert_books_balance(c)


@pytest.mark.parametrize("core", ["mysql"], indirect=True)
async def test_with_aof_durability_every_won_survives_the_crash(core: Core, tmp_path: Path) -> None:
    """Durability aof (Valkey, appendfsync always, WAITAOF per batch): every grab answered "won" is on
    disk, so an OS crash can only lose what no one was told. Here the grabs made after the last answer
    are cut (some even paid by then); every told grab is paid, and no share is told to two users."""
    async with redis_process(tmp_path, *TIMESTAMPED, "--appendfsync", "always", binary=valkey_server()) as r:
        s = core.settings.with_(redis_url=r.url, grab_durability="aof")
        async with open_core(s) as c:
            w = await make_world(c, members=90, admin_cents=100_000)
            p = await packets.send_packet(c, w.admin, w.group, "lucky", 6_000, 60)
            told: dict[int, tuple[int, int]] = {}
            for u in w.members[:30]:
                g = (await grabs.grab(c, p.packet_id, w.group, u)).grab
                told[u] = (g.seq, g.amount)
            last_answer = await next_second()
            # In flight when the machine died: executed, never answered (their answers are ignored),
            # and their credits even paid.
            for u in w.members[30:40]:
                await grabs.grab(c, p.packet_id, w.group, u)
            await CreditDrain(c).until_empty()
            await crash(r, keep_until=last_answer)

            for u in w.members[40:]:
                g = await grab_or_none(c, p.packet_id, w.group, u)
                if g is not None:
                    told[u] = (g.grab.seq, g.grab.amount)
            await CreditDrain(c).until_empty()
            held = await paid(c)
            for u, share in told.items():
                assert held.get(u) == share, u
            seqs = [seq for seq, _ in held.values()]
            assert len(seqs) == len(set(seqs)) and sum(a for _, a in held.values()) <= 6_000
            assert (await reconcile(c.db)).ok
            await assert_books_balance(c)


@needs_redis_server
async def test_grabs_are_not_answered_won_when_durability_cannot_be_had(core: Core, tmp_path: Path) -> None:
    """aof on a server without WAITAOF (Redis 7.0) or without its AOF, replica with no replica: the grab
    is made but answered redis_unavailable, never "won"; the retry answers the same share."""
    w = await make_world(core, members=2, admin_cents=10_000)
    p = await packets.send_packet(core, w.admin, w.group, "lucky", 200, 2)
    for durability in ("aof", "replica"):
        strict = dataclasses.replace(core, settings=core.settings.with_(grab_durability=durability))
        strict.batcher.durability = durability  # type: ignore[assignment]
        try:
            with pytest.raises(RedPacketError) as e:
                await grabs.grab(strict, p.packet_id, w.group, w.members[0])
            assert e.value.code == errors.REDIS_UNAVAILABLE, e.value
        finally:
            strict.batcher.durability = "none"
    got = await grabs.grab(core, p.packet_id, w.group, w.members[0])
    assert got.outcome == "already"  # taken the first time; said now
    assert await ledger.balance(core.db, w.members[0]) == 0


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
            s = core.settings.with_(redis_url=primary.url, grab_durability="replica")
            async with open_core(s) as c:
                w = await make_world(c, members=20, admin_cents=10_000)
                p = await packets.send_packet(c, w.admin, w.group, "lucky", 2_000, 20)
                got = await asyncio.gather(*(grabs.grab(c, p.packet_id, w.group, u) for u in w.members))
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
