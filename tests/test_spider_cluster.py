"""A real Spider head and three backends on this machine (``launchers.spider``): they come up with the
options the tool promises, a Spider table made by hand over the backends puts row ``id`` on backend
``id % 3``, a backend killed with ``kill -9`` fails only the queries that touch it (error 1429) and is
readable again once started, a paused one holds a query seconds, not minutes; the command prints the two
settings, starts and stops cleanly, and says in one line what an operator can fix. One cluster for the
module (~2 s to start); the tests that kill or pause a backend run last.

Not in the fast tier (``pytest -m unit``) but for the command's error lines and the compose file's
profile: it starts ``mariadbd`` processes. Skipped with the reason when ``mariadbd`` or the Spider plugin
is missing, unless REDPACKET_TEST_REQUIRE_SPIDER=1 (then it fails).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiomysql
import pytest
import yaml

from launchers import cli, mariadbd
from launchers.spider import SpiderCluster, SpiderNode, spider_cluster
from launchers.spider import __main__ as command
from tests import clustertools
from tests.clustertools import ROOT, free_block, reachable_dir, refused, up_twice
from tests.conftest import need_spider
from tests.hubtools import server_port

DATABASE = "spider_test"
UNREACHABLE = 1429  # ER_CONNECT_TO_FOREIGN_DATA_SOURCE: "Unable to connect to foreign data source: s1"


@pytest.fixture(scope="module")
async def spider(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[SpiderCluster]:
    """A head and three backends, each answering, with an empty database ``spider_test`` on all four."""
    need_spider()
    ports = [server_port() for _ in range(4)]  # never given twice in this run: a restart finds its own free
    async with spider_cluster(tmp_path_factory.mktemp("spider"), ports=ports) as cluster:
        await cluster.create_database(DATABASE)
        yield cluster


async def sql(
    node: SpiderNode, statement: str, *args: Any, database: str = DATABASE
) -> list[tuple[Any, ...]]:
    """One statement on ``node`` (autocommit), on a new connection."""
    return await clustertools.sql(node.port, database, statement, *args)


async def error_code(node: SpiderNode, statement: str) -> int:
    """The MariaDB error ``statement`` fails with."""
    with pytest.raises(aiomysql.Error) as failed:
        await sql(node, statement)
    return int(failed.value.args[0])


async def test_a_head_with_spider_and_backends_answer_with_the_promised_options(
    spider: SpiderCluster,
) -> None:
    ports = [spider.head.port, *(b.port for b in spider.backends)]
    assert len(set(ports)) == 4 and None not in {n.pid for n in spider.nodes}
    assert spider.head_url("ledger") == f"mysql://root@127.0.0.1:{ports[0]}/ledger"
    backends = [f"mysql://root@127.0.0.1:{p}/ledger" for p in ports[1:]]
    assert spider.backend_urls("ledger") == backends and spider.shards_setting("ledger") == ",".join(backends)
    assert await sql(
        spider.head, "SELECT SUPPORT FROM information_schema.ENGINES WHERE ENGINE = 'SPIDER'"
    ) in (
        [("YES",)],
        [("DEFAULT",)],
    )
    wanted = {
        "character_set_server": "utf8mb4", "log_bin": "OFF", "bind_address": "127.0.0.1",
        "innodb_buffer_pool_size": str(32 << 20), "default_storage_engine": "InnoDB",
    }  # fmt: skip
    where = "Variable_name IN ({})".format(", ".join(f"'{name}'" for name in wanted))
    for node in spider.nodes:
        assert dict(await sql(node, f"SHOW GLOBAL VARIABLES WHERE {where}")) == wanted, node.name
        assert (node.home / f"{node.name}.sock").is_socket() and node.log.exists()
        assert await sql(node, "SELECT DEFAULT_CHARACTER_SET_NAME FROM information_schema.SCHEMATA"
                         f" WHERE SCHEMA_NAME = '{DATABASE}'") == [("utf8mb4",)]  # fmt: skip
    # A backend that does not answer holds the head's thread seconds, not the default 600 s.
    timeouts = dict(await sql(spider.head, "SHOW GLOBAL VARIABLES LIKE 'spider_%'"))
    assert timeouts["spider_connect_timeout"] == "2" and timeouts["spider_connect_retry_count"] == "1"
    assert timeouts["spider_net_read_timeout"] == timeouts["spider_net_write_timeout"] == "10"


async def test_rows_written_through_the_head_land_on_backend_id_mod_3(spider: SpiderCluster) -> None:
    table = "t (id BIGINT PRIMARY KEY, v INT)"
    partitions = []
    for i, backend in enumerate(spider.backends):
        await sql(backend, f"CREATE TABLE {table} ENGINE=InnoDB")
        await sql(
            spider.head,
            f"CREATE OR REPLACE SERVER s{i} FOREIGN DATA WRAPPER mysql OPTIONS (HOST '127.0.0.1',"
            f" PORT {backend.port}, USER 'root', PASSWORD '', DATABASE '{DATABASE}')",
        )
        partitions.append(f"PARTITION p{i} COMMENT='srv \"s{i}\"'")
    await sql(
        spider.head,
        f'CREATE TABLE {table} ENGINE=SPIDER COMMENT=\'wrapper "mysql", table "t"\''
        f" PARTITION BY HASH(id) ({', '.join(partitions)})",
    )
    await sql(spider.head, "INSERT INTO t VALUES " + ", ".join(f"({i}, {i * 10})" for i in range(30)))
    assert await sql(spider.head, "SELECT COUNT(*), SUM(v) FROM t") == [(30, 4350)]
    for i, backend in enumerate(spider.backends):
        assert [id_ for (id_,) in await sql(backend, "SELECT id FROM t ORDER BY id")] == list(range(i, 30, 3))
    # An update through the head reaches the backend that holds the row.
    await sql(spider.head, "UPDATE t SET v = -1 WHERE id = 7")
    assert await sql(spider.backends[1], "SELECT v FROM t WHERE id = 7") == [(-1,)]


async def test_the_command_prints_the_settings_and_stops_every_server_on_sigterm() -> None:
    """Twice on one directory: the second run starts the same servers on the data the first left."""
    need_spider()

    async def settings_printed(stdout: asyncio.StreamReader, port: int) -> int:
        """A line a server, then the two settings; the database is on every server. The row goes on
        backend 1."""
        lines = [(await asyncio.wait_for(stdout.readline(), 60)).decode().strip() for _ in range(5)]
        for line, name, p in zip(
            lines[:3], ["head", "backend0", "backend1"], range(port, port + 3), strict=True
        ):
            assert line.startswith(f"# {name} 127.0.0.1:{p} pid "), lines
        assert lines[3] == f"REDPACKET_DATABASE_URL=mysql://root@127.0.0.1:{port}/cli", lines
        shards = f"mysql://root@127.0.0.1:{port + 1}/cli,mysql://root@127.0.0.1:{port + 2}/cli"
        assert lines[4] == f"REDPACKET_SHARDS={shards}", lines
        for p in (port, port + 1):
            conn = await aiomysql.connect(host="127.0.0.1", port=p, user="root", db="cli", autocommit=True)
            conn.close()  # the database is on the head and the backends
        return port + 2

    with reachable_dir() as directory:
        await up_twice("spider", directory, "backends", ports=3, printed=settings_printed, stop_within=60)


async def test_a_busy_port_or_a_dir_mysql_may_not_enter_is_one_line_and_exit_2(tmp_path: Path) -> None:
    need_spider()
    base = free_block(2)  # (the head's port, below the busy one, free too: it is checked first)
    with reachable_dir() as directory:
        cases = {f"port {base + 1} (backend0) is in use": ("up", str(directory), "--port", str(base))}
        await refused("spider", cases, taken=base + 1, reachable=directory, tmp_path=tmp_path, ports=4)


@pytest.mark.parametrize("missing", ["mariadbd", "plugin"])
def test_a_missing_mariadbd_or_plugin_says_what_to_install_in_one_line(
    missing: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """In-process, nothing started: the checks run before any server does."""
    monkeypatch.setattr(mariadbd, "which", lambda name: None if missing == name else "/bin/true")
    if missing == "plugin":
        missing_plugin = replace(SpiderCluster.tool, library=tmp_path / "ha_spider.so")
        monkeypatch.setattr(SpiderCluster, "tool", missing_plugin)
    directory = tmp_path / "d"  # (as root, the CLI's own check would refuse pytest's mode-700 tmp_path)
    monkeypatch.setattr(cli, "unenterable", lambda d, servers, example: "")
    assert command.main(["up", str(directory), "--port", str(free_block(4))]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1 and lines[0].startswith("spider: "), lines
    wanted = "apt-get install mariadb-plugin-spider" if missing == "plugin" else "mariadbd is not installed"
    assert wanted in lines[0] and "apt-get install" in lines[0], lines


def test_the_compose_profile_is_a_head_with_spider_and_three_backends() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    names = ["spider-head", "spider-1", "spider-2", "spider-3"]
    for name in names:
        s = services[name]
        assert s["profiles"] == ["spider"] and "ports" not in s, name
        assert s["volumes"] == [f"{name}-data:/var/lib/mysql"] and f"{name}-data" in compose["volumes"], name
        assert "--character-set-server=utf8mb4" in s["command"], name
        assert s["environment"]["MARIADB_PASSWORD"].startswith("${MARIADB_PASSWORD:?"), name
    for name in names[1:]:
        assert services[name]["image"] == "mariadb:10.11", name
    # The official image has no ha_spider.so: the head's is the image plus mariadb-plugin-spider, and
    # CREATE SERVER (run by migrate as the redpacket user) needs FEDERATED ADMIN.
    head = services["spider-head"]
    inline = head["build"]["dockerfile_inline"]
    assert inline.startswith("FROM mariadb:10.11\n") and "apt-get install" in inline, inline
    assert "mariadb-plugin-spider" in inline and "GRANT FEDERATED ADMIN ON *.* TO 'redpacket'@'%'" in inline
    flags = head["command"]
    assert "--plugin-load-add=ha_spider.so" in flags and "--spider-connect-timeout=2" in flags
    assert set(head["depends_on"]) == set(names[1:])
    for app in ("hub", "worker"):  # the plain server stays the default
        assert not set(services[app]["depends_on"]) & set(names)
    text = (ROOT / "docker-compose.yml").read_text()
    assert "REDPACKET_DATABASE_URL: mysql://redpacket:${MARIADB_PASSWORD}@spider-head:3306/redpacket" in text
    shards = ",".join(f"mysql://redpacket:${{MARIADB_PASSWORD}}@spider-{i}:3306/redpacket" for i in (1, 2, 3))
    assert f"REDPACKET_SHARDS: {shards}" in text
    assert "docker compose --profile spider up" in (ROOT / "docs" / "operations.md").read_text()


# --- last: the tests that kill or pause a backend of the module's cluster (it is whole again after each) ---


async def test_a_killed_backend_fails_only_its_rows_and_is_read_again_once_started(
    spider: SpiderCluster,
) -> None:
    victim = spider.backends[1]
    old_pid = victim.pid
    victim.kill()
    assert victim.pid is None and not victim.running
    started = time.monotonic()
    assert await error_code(spider.head, "SELECT v FROM t WHERE id = 7") == UNREACHABLE
    assert await error_code(spider.head, "SELECT COUNT(*) FROM t") == UNREACHABLE  # every partition
    assert time.monotonic() - started < 10
    # The rows of the live backends still read, and take writes, through the head.
    assert await sql(spider.head, "SELECT id FROM t WHERE id IN (3, 5) ORDER BY id") == [(3,), (5,)]
    await sql(spider.head, "UPDATE t SET v = 33 WHERE id = 3")
    await victim.start()  # InnoDB recovers from the kill; the head reconnects by itself
    assert victim.pid not in (None, old_pid)
    assert await sql(spider.head, "SELECT v FROM t WHERE id IN (3, 7) ORDER BY id") == [(33,), (-1,)]
    assert await sql(spider.head, "SELECT COUNT(*) FROM t") == [(30,)]


async def test_a_paused_backend_fails_a_query_in_seconds_and_answers_when_resumed(
    spider: SpiderCluster,
) -> None:
    hung = spider.backends[2]
    await sql(spider.head, "SELECT v FROM t WHERE id = 8")  # the head holds a connection to it
    hung.pause()
    try:
        started = time.monotonic()
        assert await error_code(spider.head, "SELECT v FROM t WHERE id = 8") == UNREACHABLE
        took = time.monotonic() - started
        assert await sql(spider.head, "SELECT v FROM t WHERE id = 4") == [(40,)]
    finally:
        hung.resume()
    assert took < 15, took  # the timeouts given to the head (2 s to connect, 10 s to read), not 600 s
    assert await sql(spider.head, "SELECT v FROM t WHERE id = 8") == [(80,)]
