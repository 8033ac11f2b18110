"""The ledger on a three-node MariaDB Galera cluster (``launchers.galera``), every process given the
multi-host URL: a storm of sends and grabs through two hub processes, paid by two worker processes, while
one node is killed with ``kill -9`` — the writer every process uses, or another — and then started again;
a node paused (a partition) serves no stale read; two writers' certification conflicts are retried and
counted. No process of ours is restarted by a test: each finds the next node on its own.

Not in the fast tier; skipped (or failed, with REDPACKET_TEST_REQUIRE_GALERA=1) without Galera.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from launchers.galera import GaleraCluster, GaleraNode, galera_cluster
from server.core import open_core
from server.money import journal, ledger
from server.money.reconcile import reconcile
from server.settings import Settings
from server.store.db import Database, DatabaseError, NotReady, RetryableError
from server.store.engines import connect
from tests.clustertools import bench, galera_ports, need_galera
from tests.conftest import fresh_database, name_deployment
from tests.hubtools import HubUnderTest, eventually, hub_process, server_port, worker_env
from tests.storms import Storm, grabber, sender, storm_world


@pytest.fixture(scope="module")
async def galera(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[GaleraCluster]:
    need_galera()
    async with galera_cluster(tmp_path_factory.mktemp("galera"), ports=galera_ports(3)) as cluster:
        yield cluster


async def _database(cluster: GaleraCluster, name: str) -> str:
    """A fresh, migrated database on the cluster (through our own client, on the multi-host URL)."""
    await cluster.create_database(name)
    url = cluster.url(name)
    await name_deployment(url)
    return url


def _one_node(url: str, node: GaleraNode) -> str:
    return re.sub(r"@[^/]+/", f"@{node.address}/", url)


async def _healthy(cluster: GaleraCluster) -> None:
    """Every node running and Synced in one cluster of three (a test that killed one has rejoined it)."""
    for node in cluster.nodes:
        if node.paused:
            node.resume()
        if not node.running:
            await cluster.rejoin(node)
    await cluster.wait_size(3, timeout=120)


async def _credited(db: Database) -> int:
    row = await db.fetchone("SELECT COUNT(*) FROM grab_records WHERE status = 'credited'")
    return int(row[0]) if row else 0


def _writer_of(metrics_port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    m = re.search(r'^redpacket_db_writer\{writer="([^"]+)"\} 1', text, re.MULTILINE)
    return m[1] if m else ""


@pytest.mark.parametrize("doomed", ["writer", "other"])
async def test_a_storm_through_a_node_killed_loses_no_won_and_no_send_is_half_there(
    galera: GaleraCluster, hub_settings: Settings, doomed: str
) -> None:
    await _healthy(galera)
    url = await _database(galera, f"storm_{doomed}")
    s = hub_settings.replace(database_url=url)
    node = galera.nodes[0] if doomed == "writer" else galera.nodes[2]
    ports = [server_port(), server_port()]
    workers = [
        subprocess.Popen(  # noqa: ASYNC220 - the two workers under test
            [sys.executable, "-m", "server", "worker"], env=worker_env(s, port), stdout=subprocess.DEVNULL
        )
        for port in ports
    ]
    try:
        async with hub_process(s) as a, hub_process(s) as b:
            storm = await _storm_through_a_kill(galera, node, s, a, b)
            assert a.process is not None and b.process is not None
            hubs_alive = a.process.poll() is None and b.process.poll() is None
            assert hubs_alive, "a hub process died"
        assert all(w.poll() is None for w in workers), "a worker process died"
        # Told to: each worker moves back to the first node of the URL.
        if doomed == "writer":
            assert {_writer_of(p) for p in ports} == {galera.nodes[1].address}, "moved back untold"
            for w in workers:
                w.send_signal(signal.SIGUSR1)
            await eventually(lambda: {_writer_of(p) for p in ports} == {galera.nodes[0].address}, 30)
        else:
            assert {_writer_of(p) for p in ports} == {galera.nodes[0].address}
    finally:
        for w in workers:
            w.terminate()
            await asyncio.to_thread(w.wait, 30)
    print(f"storm ({doomed} killed): {len(storm.sent)} sends, {len(storm.told)} grabs told")


async def _storm_through_a_kill(
    galera: GaleraCluster, node: GaleraNode, s: Settings, a: HubUnderTest, b: HubUnderTest
) -> Storm:
    admin_token, people, groups = await storm_world(a)
    storm = Storm()
    grabs: asyncio.Queue[Any] = asyncio.Queue()
    lanes = [
        asyncio.create_task(sender(a if i == 0 else b, admin_token, groups, storm, grabs)) for i in range(2)
    ]
    grabbers = [asyncio.create_task(grabber((a, b), people, storm, grabs)) for _ in range(3)]
    async with open_core(
        s.replace(database_url=_one_node(s.database_url, galera.nodes[1])), migrate=False
    ) as look:
        try:
            # The dangerous state first: grabs told "won" and not yet credited, sends going on.
            async def backlog() -> bool:
                return len(storm.told) >= 30 and await _credited(look.db) < len(storm.told)

            await eventually(backlog, 60)
            told_at_kill = len(storm.told)
            storm.killed_at = time.monotonic()
            node.kill()
            await eventually(lambda: len(storm.told) >= 2 * told_at_kill and _sends_after(storm) >= 5, 90)
        finally:
            storm.stop.set()
            for t in lanes:
                await t
            await grabs.join()
            for t in grabbers:
                t.cancel()
        gap = _first_send_after(storm)
        print(f"{node.address} killed: sends answered again {gap:.2f} s after the kill;"
              f" {len(storm.send_errors_at)} send attempts answered database_unavailable")  # fmt: skip
    await galera.rejoin(node)
    await galera.wait_size(3, timeout=120)
    async with open_core(s, migrate=False) as core:
        await eventually(lambda: _credited_is(core.db, len(storm.told)), 120)
        rows = await core.db.fetchall(
            "SELECT packet_id, user_id, amount FROM grab_records WHERE status = 'credited'"
        )
        assert {(int(p), int(u)): int(m) for p, u, m in rows} == storm.told
        # Every send answered is there once (retries were replays), with its debit; none half there.
        packets = await core.db.fetchall("SELECT id, request_id FROM red_packets")
        assert sorted(int(p) for p, _ in packets) == sorted(storm.sent.values())
        debits = await core.db.fetchone("SELECT COUNT(*) FROM journal WHERE kind = 'send'")
        assert debits is not None and int(debits[0]) == len(storm.sent)
    for each in galera.nodes:  # the books balance as every node holds them
        await galera.wait_size(3)
        async with open_core(s.replace(database_url=_one_node(s.database_url, each)), migrate=False) as c:
            report = await reconcile(c)
            assert report.ok, (each.address, report)
    return storm


def _sends_after(storm: Storm) -> int:
    return sum(asked > storm.killed_at for asked, _ in storm.send_ok_at)


def _first_send_after(storm: Storm) -> float:
    return min(done for asked, done in storm.send_ok_at if asked > storm.killed_at) - storm.killed_at


async def _credited_is(db: Database, n: int) -> bool:
    return await _credited(db) == n


async def test_a_paused_node_serves_no_stale_read_as_current(galera: GaleraCluster) -> None:
    """The writer stops (SIGSTOP: a partition, as the others see it) for longer than the group's timeout;
    a process moves to the next node and pays there. When the paused node runs again it is behind: a read
    on it (with our sessions' ``wsrep_sync_wait``) errors or waits until it has caught up — never the old
    balance — and a process opening the URL does not take it for a writer until it is synced. (Without
    ``wsrep_sync_wait`` on our sessions, the pinned process reads 100 here.)"""
    await _healthy(galera)
    url = await _database(galera, "partition")
    first = galera.nodes[0]
    db = await connect(url, 4, statement_timeout=2.0)
    pinned = await connect(_one_node(url, first), 2, statement_timeout=2.0)
    try:
        user = await ledger.create_user(db, "paused")
        assert await ledger.topup(db, user, 100, "before")
        assert db.writer == first.address
        assert await ledger.balance(pinned, user) == 100
        first.pause()
        await galera.wait_size(2, timeout=60)  # the others have dropped it: longer than the timeout
        assert await ledger.topup(db, user, 100, "during")  # moved, paid on the next node
        assert db.writer == galera.nodes[1].address and db.health.failovers == 1
        first.resume()

        # Right away: a process whose only node is the one that was away (as behind a proxy pinned to
        # it), and a process starting now on the whole URL: the balance as it is, or an error; never 100.
        async def fresh_read() -> bool:
            try:
                fresh = await connect(url, 2, statement_timeout=2.0)
            except DatabaseError as e:  # no node could serve current reads at that moment
                print(f"a process starting found no node to use: {e}")
                return False
            try:
                return await _balance_or_none(fresh, user)
            finally:
                await fresh.close()

        await asyncio.gather(
            eventually(lambda: _balance_or_none(pinned, user), 60), eventually(fresh_read, 60)
        )
        await eventually(lambda: _balance_or_none(db, user), 60)
    finally:
        await db.close()
        await pinned.close()
        await _healthy(galera)


async def _balance_or_none(db: Database, user: int) -> bool:
    """True when ``db`` answers the balance (which must be the current one), False when it errs."""
    try:
        seen = await ledger.balance(db, user)
    except DatabaseError as e:
        print(f"a read answered an error, not a stale balance: {e}")
        return False
    assert seen == 200, f"a stale balance served as current: {seen}"
    return True


async def test_a_worker_started_while_the_cluster_settles_waits_for_it_and_runs(
    galera: GaleraCluster, hub_settings: Settings, tmp_path: Path
) -> None:
    """A worker (or hub) may start while the cluster is dropping a node: every node it reaches answers
    "not now" (out of the primary component, a causal read not served). It waits for the cluster to
    settle and runs, rather than exit with the error as an operator's mistake — a worker that exited so
    under a supervisor that does not restart it never credited again (``bench storm --galera`` on a slow
    machine: 0 of 1,000)."""
    await _healthy(galera)
    url = await _database(galera, "settling")
    s = hub_settings.replace(database_url=url)
    first, others = galera.nodes[0], galera.nodes[1:]
    port = server_port()
    log = tmp_path / "worker.log"
    worker: subprocess.Popen[bytes] | None = None
    try:
        for node in others:  # the first node alone: no quorum, out of the primary component
            node.pause()
        # The state first: the one node that answers says it is not ready, and the others do not answer.
        await eventually(lambda: _not_ready(_one_node(url, first)), 60)
        with log.open("wb") as out:
            worker = subprocess.Popen(  # noqa: ASYNC220 - the worker under test
                [sys.executable, "-m", "server", "worker"], env=worker_env(s, port), stdout=out, stderr=out
            )
        await eventually(
            lambda: "the database is not ready" in log.read_text() or worker.poll() is not None, 60
        )
        assert worker.poll() is None, log.read_text()[-3000:]  # waiting, not gone
    finally:
        for node in others:
            node.resume()
    try:
        await galera.wait_size(3, timeout=120)
        # Up once the cluster is: its heartbeat reached Redis and the database (as ``worker --check`` asks).
        await eventually(lambda: worker.poll() is not None or _heartbeat(port) > 0, 120)
        assert worker.poll() is None, log.read_text()[-3000:]
        # Writing through a node of the cluster: the first, or — on a loaded machine, a look at it that
        # outlived its probe as the others came back — the next live one.
        assert _writer_of(port) in {n.address for n in galera.nodes}, log.read_text()[-3000:]
    finally:
        worker.terminate()
        await asyncio.to_thread(worker.wait, 30)
        await _healthy(galera)


async def _not_ready(url: str) -> bool:
    try:
        db = await connect(url, 1, statement_timeout=2.0)
    except NotReady as e:
        print(f"the node answers not ready: {e}")
        return True
    except DatabaseError:
        return False
    await db.close()
    return False


def _heartbeat(metrics_port: int) -> float:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return 0.0
    m = re.search(r"^redpacket_worker_healthy_at_seconds (\S+)$", text, re.MULTILINE)
    return float(m[1]) if m else 0.0


async def test_two_writers_conflicts_are_retried_counted_and_nothing_is_lost(galera: GaleraCluster) -> None:
    """Two processes writing the same account through two nodes: Galera certifies one of each conflicting
    pair and aborts the other at COMMIT (``1213``); it is run again with back-off and counted. Four lanes
    on one row through two nodes is the worst case there is: should a top-up still conflict on every one
    of its runs, its caller hears ``database_unavailable`` and asks again with the same request id, as
    docs/protocol.md says a client does — and the top-up is made once (on a machine half as fast, 1 of
    400 top-ups gave up so before the back-off was measured in the attempts' own duration)."""
    await _healthy(galera)
    url = await _database(galera, "conflicts")
    n0, n1 = galera.nodes[0], galera.nodes[1]
    one = await connect(url, 8)
    other = await connect(re.sub(r"@[^/]+/", f"@{n1.address},{n0.address}/", url), 8)
    try:
        user = await ledger.create_user(one, "hot")
        assert (one.writer, other.writer) == (n0.address, n1.address)

        asked_again: list[str] = []

        async def lane(db: Database, name: str) -> None:
            for i in range(100):
                for _ in range(5):
                    try:
                        assert await ledger.topup(db, user, 1, f"{name}{i}")
                        break
                    except RetryableError as e:  # the service's database_unavailable: asked again
                        asked_again.append(f"{name}{i}: {e}")
                else:
                    raise AssertionError(f"top-up {name}{i} given up five times: {asked_again[-5:]}")

        await asyncio.gather(
            *(lane(db, f"{side}{k}-") for side, db in (("a", one), ("b", other)) for k in range(2))
        )
        conflicts = one.health.retries["deadlock"] + other.health.retries["deadlock"]
        assert conflicts > 0, (one.health.retries, other.health.retries)
        print(f"certification conflicts retried: {conflicts} in 400 top-ups; asked again: {asked_again}")
        assert await ledger.balance(one, user) == 400 == await journal.journal_sum(other, user)
        row = await one.fetchone("SELECT COUNT(*) FROM journal WHERE account_id = %s", (user,))
        assert row is not None and int(row[0]) == 400
    finally:
        await one.close()
        await other.close()


def test_the_storm_bench_on_galera_kills_the_writer_and_every_grab_is_credited(
    mysql_url: str, redis_url: str
) -> None:
    """``bench storm --galera`` as an operator runs it (its own cluster): both sides credit every grab."""
    need_galera()
    url = fresh_database(mysql_url, "redpacket_test_bench")
    figures, said = bench(
        redis_url, url, "storm", "--galera", "--rate", "250", "--seconds", "4", "--kill-writer-after", "1"
    )
    assert figures["bench"] == "storm-galera"
    for side in ("mariadb", "galera3"):
        assert figures[f"{side}_credited"] == figures[f"{side}_grabs"] == 1000, (
            side,
            figures,
            said[-4000:],  # what the bench and its worker said, to tell why
        )
    assert figures["galera3_sends"] > 0 and figures["galera3_rejoin_s"] > 0, figures


HAPROXY_GALERA = Path(__file__).resolve().parent.parent / "deploy" / "haproxy-galera.cfg"


async def test_one_url_to_haproxy_in_front_of_the_cluster_keeps_working_through_a_writer_kill(
    galera: GaleraCluster, tmp_path: Path
) -> None:
    """The other way to reach a cluster (deploy/haproxy-galera.cfg): one URL, HAProxy picks the node. The
    writer killed: HAProxy marks it down and sends new connections to a backup; our client, on one host,
    runs the interrupted work again there. Nothing lost, nothing twice."""
    haproxy = _haproxy()
    await _healthy(galera)
    await _database(galera, "proxied")
    await _sql(galera.nodes[0], "CREATE USER IF NOT EXISTS 'haproxy'@'127.0.0.1'")
    port = server_port()
    env = {**os.environ, "GALERA_PROXY_PORT": str(port)}
    env.update({f"GALERA_NODE{i}": n.address for i, n in enumerate(galera.nodes)})
    check = await asyncio.to_thread(
        subprocess.run, [haproxy, "-c", "-f", str(HAPROXY_GALERA)], env=env, capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
    proc = subprocess.Popen(  # noqa: ASYNC220 - the proxy under test, started once
        [haproxy, "-db", "-f", str(HAPROXY_GALERA)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    db: Database | None = None
    try:
        await eventually(lambda: _answers(f"mysql://root@127.0.0.1:{port}/proxied"), 30)
        db = await connect(f"mysql://root@127.0.0.1:{port}/proxied", 4)
        assert db.writer == f"127.0.0.1:{port}"  # one host: the proxy
        user = await ledger.create_user(db, "proxied")
        for i in range(5):
            assert await ledger.topup(db, user, 100, f"before{i}")
        galera.nodes[0].kill()
        for i in range(5):  # as a client does: asked again (same request id) on database_unavailable
            await eventually(lambda i=i: _topped_up(db, user, f"after{i}"), 60)
        assert db.health.failovers == 0 and db.writer == f"127.0.0.1:{port}"
        assert await ledger.balance(db, user) == 1_000 == await journal.journal_sum(db, user)
        served = await db.fetchone("SELECT @@port")
        assert served is not None and int(served[0]) != galera.nodes[0].port  # a backup node answered
    finally:
        if db is not None:
            await db.close()
        proc.terminate()
        await asyncio.to_thread(proc.wait, 30)
        await _healthy(galera)


def _haproxy() -> str:
    exe = shutil.which("haproxy") or ("/usr/sbin/haproxy" if os.path.exists("/usr/sbin/haproxy") else None)
    if exe is None:
        if os.environ.get("REDPACKET_TEST_REQUIRE_HAPROXY") == "1":
            pytest.fail("HAProxy is required (REDPACKET_TEST_REQUIRE_HAPROXY=1): apt-get install haproxy")
        pytest.skip("no HAProxy: apt-get install haproxy")
    return exe


async def _topped_up(db: Database, user: int, request_id: str) -> bool:
    try:
        await ledger.topup(db, user, 100, request_id)
    except DatabaseError as e:  # HAProxy had not marked the dead node down yet
        print(f"a top-up answered an error (asked again): {e}")
        return False
    return True


async def _answers(url: str) -> bool:
    try:
        db = await connect(url, 1, statement_timeout=2.0)
    except DatabaseError:
        return False
    await db.close()
    return True


async def _sql(node: GaleraNode, statement: str) -> None:
    db = await connect(f"mysql://root@{node.address}/mysql", 1)
    try:
        await db.fetchall(statement)
    finally:
        await db.close()
