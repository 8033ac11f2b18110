"""A real three-node MariaDB Galera cluster on this machine (``launchers.galera``): it forms, replicates,
survives a node killed with ``kill -9`` and takes it back, comes back after every node was killed, and
its command starts and stops cleanly. One cluster for the module (~10 s to start); the tests that kill
nodes run last.

Not in the fast tier (``pytest -m unit``): it starts ``mariadbd`` processes. Skipped with the reason when
``mariadbd`` or the Galera library is missing, unless REDPACKET_TEST_REQUIRE_GALERA=1 (then it fails).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from launchers.galera import GaleraCluster, GaleraNode, galera_cluster
from launchers.galera.node import grastate
from tests import clustertools
from tests.clustertools import galera_ports, need_galera, reachable_dir, refused, up_twice
from tests.hubtools import server_port

DATABASE = "galera_test"


@pytest.fixture(scope="module")
async def galera(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[GaleraCluster]:
    """Three nodes, every one Synced and seeing the others, with an empty database ``galera_test``."""
    need_galera()
    async with galera_cluster(tmp_path_factory.mktemp("galera"), ports=galera_ports(3)) as cluster:
        await cluster.create_database(DATABASE)
        yield cluster


async def sql(
    node: GaleraNode, statement: str, *args: Any, database: str = DATABASE
) -> list[tuple[Any, ...]]:
    """One statement on ``node`` (autocommit), after every write the cluster committed before it
    (``wsrep_sync_wait=1``: without it a read on another node may lag the write)."""
    return await clustertools.sql(
        node.port, database, statement, *args, before=["SET SESSION wsrep_sync_wait=1"]
    )


async def test_three_nodes_form_one_primary_cluster_all_synced(galera: GaleraCluster) -> None:
    statuses = [await node.status() for node in galera.nodes]
    for status in statuses:
        assert status["wsrep_cluster_size"] == "3", status
        assert status["wsrep_cluster_status"] == "Primary" and status["wsrep_local_state_comment"] == "Synced"
        assert status["wsrep_ready"] == "ON" and status["wsrep_connected"] == "ON"
    assert len({s["wsrep_cluster_state_uuid"] for s in statuses}) == 1  # one cluster, not three
    assert len({node.pid for node in galera.nodes}) == 3 and None not in {node.pid for node in galera.nodes}
    hosts = ",".join(f"127.0.0.1:{node.port}" for node in galera.nodes)
    assert galera.url("ledger") == f"mysql://root@{hosts}/ledger"
    # The options of the notes: utf8mb4, InnoDB, row-based replication, interleaved auto-increment locks.
    variables = dict(
        await sql(
            galera.nodes[1],
            "SHOW GLOBAL VARIABLES WHERE Variable_name IN ('character_set_server', 'binlog_format',"
            " 'innodb_autoinc_lock_mode', 'default_storage_engine', 'wsrep_sst_method', 'max_connections')",
        )
    )
    assert variables == {
        "character_set_server": "utf8mb4", "binlog_format": "ROW", "innodb_autoinc_lock_mode": "2",
        "default_storage_engine": "InnoDB", "wsrep_sst_method": "rsync", "max_connections": "200",
    }  # fmt: skip


async def test_a_row_written_on_node_0_is_read_on_nodes_1_and_2(galera: GaleraCluster) -> None:
    first, *others = galera.nodes
    await sql(
        first, "CREATE TABLE notes (id BIGINT AUTO_INCREMENT PRIMARY KEY, body VARCHAR(40)) ENGINE=InnoDB"
    )
    await sql(first, "INSERT INTO notes (body) VALUES (%s)", "恭喜发财 from node 0")
    for node in others:
        assert await sql(node, "SELECT body FROM notes") == [("恭喜发财 from node 0",)], node.index
    # And the other way: a write on node 2 is read on node 0.
    await sql(others[1], "INSERT INTO notes (body) VALUES ('from node 2')")
    assert [b for (b,) in await sql(first, "SELECT body FROM notes ORDER BY id")][-1] == "from node 2"


async def test_the_command_prints_a_url_that_answers_and_stops_every_node_on_sigterm() -> None:
    """Twice on one directory: the second run starts the same cluster from the data the first left."""
    need_galera()

    async def url_answers(stdout: asyncio.StreamReader, port: int) -> int:
        """One line, the two nodes' URL, which answers: a cluster of two. The row goes on node 1."""
        line = (await asyncio.wait_for(stdout.readline(), 120)).decode().strip()
        assert line == f"mysql://root@127.0.0.1:{port},127.0.0.1:{port + 1}/cli", line
        size = await clustertools.sql(port + 1, "cli", "SHOW STATUS LIKE 'wsrep_cluster_size'")
        assert size == [("wsrep_cluster_size", "2")]
        return port + 1

    with reachable_dir() as directory:
        await up_twice("galera", directory, "nodes", ports=8, printed=url_answers, stop_within=90)
        assert grastate(directory / "node0")["safe_to_bootstrap"] == "1"  # node 0 stopped last


async def test_what_an_operator_can_fix_is_one_line_and_exit_2(tmp_path: Path) -> None:
    need_galera()
    taken = server_port()
    with reachable_dir() as directory:
        cases = {f"port {taken} (node 0) is in use": ("up", str(directory), "--port", str(taken))}
        await refused("galera", cases, taken=taken, reachable=directory, tmp_path=tmp_path, ports=12)


# --- last: the tests that kill nodes of the module's cluster (it is whole again after each) ---


async def test_a_node_killed_with_kill_9_leaves_two_that_commit_and_rejoins(galera: GaleraCluster) -> None:
    first, second, victim = galera.nodes
    await sql(first, "CREATE TABLE crash (id BIGINT AUTO_INCREMENT PRIMARY KEY, node INT)")
    await sql(first, "INSERT INTO crash (node) VALUES (0)")
    # The victim has applied both before it dies. Killed while it applied the CREATE TABLE (a hog run
    # starved it that long), it came back Synced at a position past a table it did not have, and went
    # Inconsistent at the first row of it: a crash inside DDL, not the crash this test is about.
    assert await sql(victim, "SELECT node FROM crash") == [(0,)]
    old_pid = victim.pid
    victim.kill()
    assert victim.pid is None and await victim.status() == {}
    await galera.wait_size(2, timeout=30)  # the others drop it within the evs timeouts (~3 s)
    await sql(first, "INSERT INTO crash (node) VALUES (0)")
    await sql(second, "INSERT INTO crash (node) VALUES (1)")
    await galera.rejoin(victim)
    assert victim.pid not in (None, old_pid)
    await galera.wait_size(3)
    # Every row, whatever their ids: Galera gives each node its auto-increment offset by its place in the
    # membership, so after the victim left, the second node's row may take the lower id (a hog run did).
    assert sorted(await sql(victim, "SELECT node FROM crash")) == [(0,), (0,), (1,)]
    await sql(victim, "INSERT INTO crash (node) VALUES (2)")  # and it takes writes again
    assert len(await sql(first, "SELECT id FROM crash")) == 4


async def test_a_paused_node_is_dropped_and_comes_back_when_resumed(galera: GaleraCluster) -> None:
    first, hung, _ = galera.nodes
    hung.pause()
    try:
        await galera.wait_size(2, timeout=30)
        await sql(first, "INSERT INTO crash (node) VALUES (0)")
    finally:
        hung.resume()
    await galera.wait_size(3)
    assert len(await sql(hung, "SELECT id FROM crash")) == 5


async def test_every_node_killed_the_most_advanced_one_bootstraps_again(galera: GaleraCluster) -> None:
    await sql(galera.nodes[0], "INSERT INTO crash (node) VALUES (0)")
    for node in galera.nodes:
        node.kill()
    # Killed, no node is marked safe to bootstrap: start() recovers each one's position and picks.
    assert {grastate(n.datadir)["safe_to_bootstrap"] for n in galera.nodes} == {"0"}
    await galera.start()
    for node in galera.nodes:
        assert len(await sql(node, "SELECT id FROM crash")) == 6, node.index
