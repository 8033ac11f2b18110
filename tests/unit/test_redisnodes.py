"""``server.store.redisnodes`` and ``server.store.identities`` without a Redis: which server answered at an
address and when that counts as a change (``Identities``, ``ServerChanged``), reading a server's data id,
parsing URLs and answers, and the packed connections' bytes. The connection tests talk to a fake server
on a local port that speaks just enough RESP; the clock is the test's."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis
from redis.asyncio.connection import SSLConnection, UnixDomainSocketConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from server.store import identities, redisnodes
from server.store.identities import LOOK_FIRST_AFTER, Identities, data_id
from server.store.redisconn import (
    PackedConnection,
    PackedSSLConnection,
    PackedUnixConnection,
    ServerChanged,
    address_of,
    packed_class,
)
from server.store.redisnodes import RedisNodes, is_cluster_url, moved
from tests.unit.fakes import Clock


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    for module in (identities, redisnodes):
        monkeypatch.setattr(module, "time", c)
    return c


# -- which server answered: Identities --------------------------------------------------------------------


def test_a_server_met_first_is_no_change_and_the_same_server_again_is_none() -> None:
    ids = Identities()
    assert ids.saw("h:1", "run-a", "master:r1") is False  # met for the first time: not a change
    assert ids.seen["h:1"] == ("run-a", "master:r1")
    first = ids.generation
    assert ids.saw("h:1", "run-a", "master:r1") is False
    assert ids.saw("h:1", data="master:r1") is False  # a look at its data alone keeps its run id
    assert ids.saw("h:1", run_id="run-a") is False
    assert ids.generation == first
    assert ids.saw("h:2", "run-b", "master:r2") is False  # another address is another server
    assert ids.seen["h:1"] == ("run-a", "master:r1")


@pytest.mark.parametrize(
    ("run_id", "data", "why"),
    [
        ("run-b", None, "a restart: another process"),
        (None, "master:r2", "demoted, resynced from another and promoted again: the same process"),
        (None, "slave:r1", "it turned replica"),
        ("run-b", "master:r2", "replaced outright"),
    ],
)
def test_another_server_or_other_data_at_an_address_is_a_change(
    run_id: str | None, data: str | None, why: str
) -> None:
    ids = Identities()
    ids.saw("h:1", "run-a", "master:r1")
    before = ids.generation
    assert ids.saw("h:1", run_id, data) is True, why
    assert ids.generation == before + 1
    assert ids.saw("h:1", run_id, data) is False  # the change is counted once
    assert ids.generation == before + 1


def test_a_look_records_when_and_a_connection_s_check_does_not(clock: Clock) -> None:
    ids = Identities()
    ids.saw("h:1", "run-a", "master:r1", look=False)
    assert "h:1" not in ids.looked
    clock.advance(5)
    ids.saw("h:1", data="master:r1")
    assert ids.looked["h:1"] == clock.monotonic()


# -- what a server's answers say ------------------------------------------------------------------------


INFO = (
    "# Server\r\nredis_version:7.2.4\r\nrun_id:{run_id}\r\n\r\n"
    "# Replication\r\nrole:{role}\r\nconnected_slaves:{replicas}\r\n"
    "master_replid:{replid}\r\nmaster_repl_offset:0\r\n"
)


def test_the_data_id_is_role_and_replication_id() -> None:
    text = INFO.format(run_id="x" * 40, role="master", replicas=1, replid="a" * 40)
    assert data_id(text) == f"master:{'a' * 40}"
    assert data_id(text.encode()) == data_id(text)
    assert data_id(text.replace("role:master", "role:slave")) == f"slave:{'a' * 40}"
    assert data_id("# Replication\r\nrole:master") == "master:"  # no id said: blank, still compared
    assert data_id("") == ":"


def test_only_a_moved_slot_or_a_reconfiguring_cluster_is_moved() -> None:
    for said in ("MOVED 3999 127.0.0.1:7002", "ASK 3999 127.0.0.1:7002", "CLUSTERDOWN Hash slot not served"):
        assert moved(ResponseError(said)), said
    assert moved(ResponseError("TRYAGAIN Multiple keys request during rehashing of slot"))
    assert not moved(ResponseError("NOSCRIPT No matching script"))
    assert not moved(RedisConnectionError("Error 111 connecting to 127.0.0.1:7000 (MOVED elsewhere)"))


def test_urls_name_one_server_or_a_cluster_of_seeds() -> None:
    assert is_cluster_url("redis+cluster://a:7000,b:7001")
    assert not any(is_cluster_url(u) for u in ("redis://a:7000", "rediss://a:7000", "unix:///tmp/r.sock"))
    nodes = RedisNodes("redis+cluster://a:7000,b,[::1]:7002/0", 1)
    startup = nodes.client.nodes_manager.startup_nodes  # type: ignore[attr-defined]
    assert sorted(startup) == ["::1:7002", "a:7000", "b:6379"]  # a seed without a port is on 6379
    assert nodes.cluster and not RedisNodes("redis://a:7000/0", 1).cluster


def test_where_a_connection_goes_is_named_host_port_or_its_socket_path() -> None:
    assert address_of("10.0.0.1", 7000) == "10.0.0.1:7000"
    assert RedisNodes.address({"host": "10.0.0.1", "port": 7000}) == "10.0.0.1:7000"
    assert RedisNodes.address({"path": "/tmp/r.sock", "host": "ignored"}) == "/tmp/r.sock"
    assert RedisNodes.address({}) == "127.0.0.1:6379"
    # A look at a server is recorded under the name its connections give it (a unix socket's path too):
    # else the identity read on connecting and the one read by a look would be two servers' (a stamp
    # written on one would never match).
    assert RedisNodes._address(Redis(unix_socket_path="/tmp/r.sock")) == "/tmp/r.sock"
    assert RedisNodes._address(Redis(host="10.0.0.1", port=7000)) == "10.0.0.1:7000"


def test_a_packet_is_stamped_with_its_server_on_one_server_only() -> None:
    one = RedisNodes("redis://10.0.0.1:7000/0", 1)
    assert one.data_stamp("k") == ""  # not met yet
    one.identities.saw("10.0.0.1:7000", "run1", "master:repl1")
    assert one.data_stamp("k") == "run1/master:repl1"
    # On a cluster a slot moved away and back would bring a stamp naming its first master again.
    cluster = RedisNodes("redis+cluster://10.0.0.1:7000", 1)
    cluster.identities.saw("10.0.0.1:7000", "run1", "master:repl1")
    assert cluster.data_stamp("k") == ""


def test_a_url_s_kind_of_connection_is_kept_when_packed() -> None:
    assert packed_class(SSLConnection) is PackedSSLConnection
    assert packed_class(UnixDomainSocketConnection) is PackedUnixConnection
    assert packed_class(PackedConnection) is PackedConnection
    assert packed_class(object) is PackedConnection


def test_multi_word_commands_go_out_as_separate_words() -> None:
    conn = PackedConnection(host="127.0.0.1", port=1)
    wire = b"*2\r\n$4\r\nINFO\r\n$11\r\nREPLICATION\r\n"
    assert conn.pack_command("INFO REPLICATION") == [wire]
    assert conn.pack_command(b"INFO REPLICATION") == [wire]
    assert conn.pack_command("INFO", "REPLICATION") == [wire]
    assert conn.pack_command("GET", "a b") == [b"*2\r\n$3\r\nGET\r\n$3\r\na b\r\n"]  # an argument kept whole


def test_a_dedicated_connection_is_made_like_the_pool_s_and_reports_to_the_same_identities() -> None:
    nodes = RedisNodes("redis://10.0.0.1:7000/3", 4)
    kwargs = nodes.dedicated("any key")
    assert "max_connections" not in kwargs and kwargs["identities"] is nodes.identities
    assert RedisNodes.address(kwargs) == "10.0.0.1:7000"
    conn = RedisNodes.connect_dedicated(kwargs)
    assert type(conn) is PackedConnection and (conn.host, conn.port, conn.db) == ("10.0.0.1", 7000, 3)
    assert kwargs["connection_class"] is PackedConnection  # (what it was made from is left as it was)


# -- against a fake server on a local port ----------------------------------------------------------------


class FakeServer:
    """A Redis on a local port that answers INFO with the run id, role and replication id the test sets,
    PING with PONG, and anything else OK. Records each connection's commands."""

    def __init__(self) -> None:
        self.run_id = "a" * 40
        self.role = "master"
        self.replid = "1" * 40
        self.replicas = 0
        self.sessions: list[list[list[bytes]]] = []
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def restart(self) -> None:
        self.run_id = "b" * 40

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        session: list[list[bytes]] = []
        self.sessions.append(session)
        self._writers.add(writer)
        try:
            while line := await reader.readline():
                args = []
                for _ in range(int(line[1:])):
                    size = int((await reader.readline())[1:])
                    args.append((await reader.readexactly(size + 2))[:-2])
                session.append(args)
                writer.write(self._answer(args))
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    def _answer(self, args: list[bytes]) -> bytes:
        if args[0].upper() == b"INFO":
            text = INFO.format(run_id=self.run_id, role=self.role, replicas=self.replicas, replid=self.replid)
            return b"$%d\r\n%s\r\n" % (len(text), text.encode())
        if args[0].upper() == b"PING":
            return b"+PONG\r\n"
        return b"+OK\r\n"

    async def __aenter__(self) -> FakeServer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()
        for writer in list(self._writers):
            writer.close()
        await self.server.wait_closed()


@pytest.fixture
async def fake() -> AsyncIterator[FakeServer]:
    async with FakeServer() as server:
        yield server


async def connected(fake: FakeServer, ids: Identities) -> PackedConnection:
    conn = PackedConnection(host="127.0.0.1", port=fake.port, identities=ids)
    await conn.connect()
    return conn


async def test_a_connection_to_a_restarted_server_sends_nothing_and_the_next_one_goes_through(
    fake: FakeServer,
) -> None:
    ids = Identities()
    for _ in range(2):  # met, then met again: the same server
        conn = await connected(fake, ids)
        await conn.disconnect()
    generation = ids.generation
    fake.restart()
    with pytest.raises(ServerChanged):
        await connected(fake, ids)
    assert [args[0] for args in fake.sessions[-1]][-1] == b"INFO"  # nothing went out after the check
    assert ids.generation == generation + 1
    conn = await connected(fake, ids)  # checked against the database meanwhile: the next one is used
    await conn.send_command("PING")
    assert await conn.read_response() == b"PONG"
    await conn.disconnect()
    assert ids.generation == generation + 1


async def test_a_server_whose_data_was_replaced_is_a_change_to_a_new_connection(fake: FakeServer) -> None:
    ids = Identities()
    await (await connected(fake, ids)).disconnect()
    fake.replid = "2" * 40  # demoted, synced from another master, promoted: same run id, other data
    with pytest.raises(ServerChanged):
        await connected(fake, ids)
    assert ids.seen[fake.address] == (fake.run_id, f"master:{fake.replid}")


async def test_a_look_reads_the_data_id_and_counts_replicas_and_says_when_to_look_again(
    fake: FakeServer, clock: Clock
) -> None:
    nodes = RedisNodes(f"redis://127.0.0.1:{fake.port}/0", 2)
    try:
        await nodes.open()  # its connection met the server: not a look
        client = nodes.client
        assert nodes.look_first(client) and nodes.replicas(client) is None
        fake.replicas = 2
        await nodes.look(client, replicas=True)
        assert nodes.replicas(client) == 2
        assert not nodes.look_first(client)
        clock.advance(LOOK_FIRST_AFTER / 2)
        assert not nodes.look_first(client)
        clock.advance(LOOK_FIRST_AFTER)
        assert nodes.look_first(client)
        await nodes.look(client)
        nodes.look_again(client)  # it answered as a replica, or moved a slot
        assert nodes.look_first(client)
        generation = nodes.generation
        fake.replid = "3" * 40
        await nodes.look(client)  # an open connection sees the change at the next look
        assert nodes.generation == generation + 1
        assert nodes.replicas(client) == 2  # a look that does not count keeps the last count
        assert nodes.masters() == {fake.address: client}
    finally:
        await nodes.aclose()
