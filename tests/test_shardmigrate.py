"""Later migrations of a sharded ledger (``server.store.shards.make_sharded``), on a real Spider head and
three backends: a ledger made at version 10, with packets on every shard, brought to the latest version
(migration 11 adds ``red_packets.seed``): each backend altered, the head's Spider table made again from
backend 0's new definition, the rows still there through the head and a new row's seed on its backend;
run again, nothing changes. A run stopped half-way (a backend unreachable; the head lost after its
definitions were made again, a swap's table left behind) is run again to the end. A migration statement
whose table cannot be told is refused before any backend is changed. (The statements' classification
alone: ``tests/unit/test_shards.py``.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from launchers.spider import SpiderCluster
from server.store import schema, shards
from server.store.db import Database, DatabaseError
from server.store.engines import connect
from server.store.schema import pending
from server.store.shards import SHARDED, make_sharded, spider_table
from tests.conftest import rows_at

SEED = "ab" * 32
NEXT = schema.LATEST + 1  # a migration of a test's own, after every real one
SINCE_10 = [v for v, _, _ in schema.MIGRATIONS if v > 10]  # what a ledger at version 10 is brought through


async def _make(cluster: SpiderCluster, name: str, opener: Callable[[str], Any] | None = None) -> list[str]:
    """``redpacket migrate`` with REDPACKET_SHARDS, on a head connection of its own (``connect`` reads
    the shard count from the head, as a real run does)."""
    head = await connect(cluster.head_url(name), 1)
    try:
        return await make_sharded(
            head, name, cluster.backend_urls(name), opener or (lambda url: connect(url, 1))
        )
    finally:
        await head.close()


async def _pending_everywhere(cluster: SpiderCluster, name: str) -> list[list[int]]:
    """What the head, then each backend, has not applied."""
    out = []
    for url in [cluster.head_url(name), *cluster.backend_urls(name)]:
        db = await connect(url, 1)
        try:
            out.append(await pending(db))
        finally:
            await db.close()
    return out


async def _six_packets(cluster: SpiderCluster, name: str) -> None:
    """Packets 1 to 6 written through the head: two on each shard, two shares each."""
    rows = ", ".join(f"({i}, 1, 1, 'random', 100, 2, 'hi', 'open', 1, 2)" for i in range(1, 7))
    await rows_at(
        cluster.head_url(name),
        "INSERT INTO red_packets (id, sender_id, group_id, kind, total, share_count, greeting, status,"
        f" created_ms, expires_ms) VALUES {rows}",
    )


async def _at_version_10(cluster: SpiderCluster, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sharded ledger made by the migrate of version 10, six packets through the head (two a shard)."""
    await cluster.create_database(name)
    with monkeypatch.context() as m:
        m.setattr(schema, "MIGRATIONS", [x for x in schema.MIGRATIONS if x[0] <= 10])
        m.setattr(schema, "LATEST", 10)
        await _make(cluster, name)
        assert await _pending_everywhere(cluster, name) == [[]] * 4
    await _six_packets(cluster, name)
    assert "`seed`" not in await _create(cluster.head_url(name), "red_packets")


async def _create(url: str, table: str) -> str:
    (_, create), *_ = await rows_at(url, f"SHOW CREATE TABLE {table}")
    return str(create)


async def _head_tables(cluster: SpiderCluster, name: str) -> dict[str, str]:
    return {table: await _create(cluster.head_url(name), table) for table in SHARDED}


async def _ids_through_head(cluster: SpiderCluster, name: str) -> list[tuple[int, str | None]]:
    rows = await rows_at(cluster.head_url(name), "SELECT id, seed FROM red_packets ORDER BY id")
    return [(int(i), s) for i, s in rows]


async def _ids_through_head_old(cluster: SpiderCluster, name: str) -> list[int]:
    """The packets' ids through the head, naming no column a definition of version 10 lacks."""
    return [
        int(r[0]) for r in await rows_at(cluster.head_url(name), "SELECT id FROM red_packets ORDER BY id")
    ]


async def test_a_ledger_at_version_10_is_brought_to_the_latest_with_its_rows(
    spider: SpiderCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = "upgrade"
    await _at_version_10(spider, name, monkeypatch)
    head = await connect(spider.head_url(name), 1)
    try:
        assert head.shards == 3
        with pytest.raises(DatabaseError, match="applied by `redpacket migrate` with REDPACKET_SHARDS"):
            await schema.migrate(head)  # a process starting does not migrate a head
    finally:
        await head.close()

    lines = await _make(spider, name)
    create = await _create(spider.head_url(name), "red_packets")
    assert "`seed` char(64)" in create and "ENGINE=SPIDER" in create, create
    assert await _pending_everywhere(spider, name) == [[]] * 4
    assert await _ids_through_head(spider, name) == [(i, None) for i in range(1, 7)]
    for shard, url in enumerate(spider.backend_urls(name)):
        held = await rows_at(url, "SELECT id FROM red_packets ORDER BY id")
        assert [int(r[0]) for r in held] == [i for i in range(1, 7) if i % 3 == shard]  # not moved

    # A packet with its seed, written through the head, lands on its backend with the seed.
    await rows_at(
        spider.head_url(name),
        "INSERT INTO red_packets (id, sender_id, group_id, kind, total, share_count, greeting, status,"
        f" created_ms, expires_ms, seed) VALUES (7, 1, 1, 'random', 100, 2, 'hi', 'open', 1, 2, '{SEED}')",
    )
    for shard, url in enumerate(spider.backend_urls(name)):
        there = await rows_at(url, "SELECT seed FROM red_packets WHERE id = 7")
        assert there == ([(SEED,)] if shard == 7 % 3 else []), shard
    assert (await _ids_through_head(spider, name))[-1] == (7, SEED)
    assert [line.rsplit(": ", 1)[1] for line in lines if line.startswith("shard ")] == [
        f"migrations applied {SINCE_10}"
    ] * 3
    assert "head: red_packets made again over the backends' new definition" in lines
    assert "head: grab_records made again over the backends' new definition" in lines  # (an index: 12)
    assert "head: events made again over the backends' new definition" in lines  # (columns: 13)
    assert "head: journal made again over the backends' new definition" in lines  # (an index: 13)
    assert lines[-1] == f"head: migrations applied {SINCE_10}" and len(lines) == 8, lines

    # Run again: nothing changes.
    before = await _head_tables(spider, name)
    again = await _make(spider, name)
    assert again == [line for line in again if line.endswith("migrations applied none")] and len(again) == 4
    assert await _head_tables(spider, name) == before
    assert len(await _ids_through_head(spider, name)) == 7


async def test_a_run_stopped_half_way_is_run_again_to_the_end(
    spider: SpiderCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = "halfway"
    await _at_version_10(spider, name, monkeypatch)
    urls = spider.backend_urls(name)

    async def third_unreachable(url: str) -> Database:
        if url == urls[2]:
            raise DatabaseError("backend 2 cannot be reached")
        return await connect(url, 1)

    with pytest.raises(DatabaseError, match="backend 2"):
        await _make(spider, name, third_unreachable)
    assert await _pending_everywhere(spider, name) == [SINCE_10, [], [], SINCE_10]
    # Meanwhile the head's old definitions still read every shard (the new column is not theirs).
    assert await _ids_through_head_old(spider, name) == list(range(1, 7))

    real = shards.migrate

    async def head_lost(db: Database, **kwargs: Any) -> list[int]:
        if kwargs.get("runs_here") is not None:  # the head's own migrations: after its definitions
            raise DatabaseError("the head's connection was lost")
        return await real(db, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(shards, "migrate", head_lost)
        with pytest.raises(DatabaseError, match="head's connection"):
            await _make(spider, name)
    assert await _pending_everywhere(spider, name) == [SINCE_10, [], [], []]
    assert "`seed`" in await _create(spider.head_url(name), "red_packets")  # made again, not recorded
    # And a swap stopped between making its new table and the RENAME.
    backend_create = await _create(urls[0], "red_packets")
    servers = [shards.server_name(name, i) for i in range(3)]
    await rows_at(
        spider.head_url(name),
        spider_table(backend_create, "red_packets", "id", servers, name="rp_new_red_packets"),
    )

    lines = await _make(spider, name)
    assert "head: red_packets made again over the backends' new definition" in lines
    assert lines[-1] == f"head: migrations applied {SINCE_10}", lines
    assert await _pending_everywhere(spider, name) == [[]] * 4
    assert await _ids_through_head(spider, name) == [(i, None) for i in range(1, 7)]
    left = await rows_at(
        spider.head_url(name),
        "SELECT table_name FROM information_schema.tables WHERE table_schema = DATABASE()"
        " AND table_name REGEXP '^rp_(new|old)_'",
    )
    assert left == []


async def test_a_data_update_of_a_sharded_table_runs_once_on_each_row(
    spider: SpiderCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = "update"
    await spider.create_database(name)
    await _make(spider, name)
    await _six_packets(spider, name)
    more = "UPDATE red_packets SET share_count = share_count + 1"  # not idempotent: run twice, shows
    monkeypatch.setattr(schema, "MIGRATIONS", [*schema.MIGRATIONS, (NEXT, "one share more", [more])])
    lines = await _make(spider, name)
    assert lines[-1] == f"head: migrations applied [{NEXT}]", lines
    counts = await rows_at(spider.head_url(name), "SELECT id, share_count FROM red_packets ORDER BY id")
    assert [(int(i), int(n)) for i, n in counts] == [(i, 3) for i in range(1, 7)]


async def test_a_migration_that_cannot_be_placed_is_refused_before_any_backend_changes(
    spider: SpiderCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = "unplaced"
    await spider.create_database(name)
    await _make(spider, name)
    joined = "UPDATE red_packets JOIN users ON users.id = red_packets.sender_id SET greeting = users.name"
    monkeypatch.setattr(schema, "MIGRATIONS", [*schema.MIGRATIONS, (NEXT, "a join", [joined])])
    with pytest.raises(
        DatabaseError, match=rf"^migration {NEXT}: cannot tell which table .*UPDATE red_packets JOIN"
    ):
        await _make(spider, name)
    assert await _pending_everywhere(spider, name) == [[NEXT]] * 4
