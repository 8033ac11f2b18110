"""What an operator meets: every URL form docs/configuration.md offers works, and every mistake is one
line and an exit code — never a traceback, a hang, or a false all-clear."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import msgpack
import redis

from server.core import Core
from server.live.bots import lift, list_blocks, now_ms, run_detector
from server.money import groups, ledger
from server.settings import Settings, child_env
from server.store import keys
from tests.clitools import assert_one_line_error, redpacket
from tests.hubtools import eventually, hub_in_process, hub_url, redpacket_up
from tests.redisproc import needs_redis_server, redis_process


@needs_redis_server
async def test_redis_over_a_unix_socket(tmp_path: Path, hub_settings: Settings) -> None:
    """Before: `REDPACKET_REDIS_URL=unix:///…/r.sock`, which the configuration offers, crashed at the first
    connection (TypeError: … unexpected keyword argument 'identities')."""
    sock = tmp_path / "r.sock"
    async with redis_process(tmp_path / "redis", "--unixsocket", str(sock), "--unixsocketperm", "700"):
        settings = hub_settings.replace(redis_url=f"unix://{sock}", queue_redis_url="")
        async with hub_in_process(settings, run_worker=True) as h:
            admin, admin_token = await h.login("wang")
            member, member_token = await h.login("li")
            await ledger.topup(h.core.db, admin, 1_000, "seed")
            group = await groups.create_group(h.core.db, admin, "family")
            await groups.add_members(h.core.db, h.core.membership, group, [member])
            li = await h.client(member_token)
            wang = await h.client(admin_token)
            sent = await wang.request("send", group=group, kind="lucky", total=300, count=1)
            while (await li.next_event())["event"] != "packet":  # heard through the socket's pub/sub
                pass
            got = await li.request("grab", group=group, packet=sent["packet_id"])
            assert got["amount"] == 300

            async def paid() -> bool:
                return await ledger.balance(h.core.db, member) == 300

            await eventually(paid, timeout=60)  # the worker read the outbox over the socket too
            await li.close()
            await wang.close()


def test_malformed_urls_and_settings_are_one_line_at_start(
    tmp_path: Path, redis_url: str, mysql_url: str
) -> None:
    """Before: tracebacks for a port that is not a number or a broken IPv6 address; a Redis database
    that is not a number and a negative leeway were taken silently; a MySQL URL without a database used
    `redpacket` without saying so."""
    db, queue = {"REDPACKET_DATABASE_URL": mysql_url}, {"REDPACKET_QUEUE_REDIS_URL": redis_url}
    cases: list[tuple[dict[str, str], str]] = [
        (
            {"REDPACKET_DATABASE_URL": "mysql://root@127.0.0.1:abc/x"},
            "DATABASE_URL has a host that cannot be read",
        ),
        ({"REDPACKET_DATABASE_URL": "mysql://root@[::1/x"}, "DATABASE_URL has a host that cannot be read"),
        ({"REDPACKET_DATABASE_URL": "mysql://root@127.0.0.1:3306"}, "DATABASE_URL names no database"),
        ({"REDPACKET_REDIS_URL": "redis://127.0.0.1:abc", **db}, "REDIS_URL has a host that cannot be read"),
        ({"REDPACKET_REDIS_URL": "redis+cluster://127.0.0.1:abc", **queue, **db}, "cannot be read"),
        ({"REDPACKET_REDIS_URL": "redis://127.0.0.1:6379/abc", **db}, "Redis database that is not a number"),
        (
            {"REDPACKET_JWT_LEEWAY_SECONDS": "-5", **db},
            "REDPACKET_JWT_LEEWAY_SECONDS must be a number 0 or more",
        ),
        ({"REDPACKET_MSGS_BURST": "0", **db}, "REDPACKET_MSGS_BURST must be a number more than 0"),
        (
            {"REDPACKET_MSGS_PER_SECOND": "nan", **db},
            "REDPACKET_MSGS_PER_SECOND must be a number more than 0",
        ),
        ({"REDPACKET_DATABASE_URL": "mariadb://root@127.0.0.1:3306"}, "DATABASE_URL names no database"),
    ]
    for env, words in cases:
        assert_one_line_error(redpacket("reconcile", REDPACKET_DATA_DIR=str(tmp_path), **env), 2, words)
    # What redis-py reads is read: a database or TLS option as a query, no path.
    for url in ("redis://127.0.0.1:6379/?db=2", "rediss://127.0.0.1/?ssl_cert_reqs=none", "redis://h:1/3"):
        Settings(redis_url=url, database_url=mysql_url, secret="s" * 32).check()


def test_what_is_wrong_with_a_service_is_said_as_it_is(
    tmp_path: Path, redis_url: str, mysql_url: str
) -> None:
    """Before: "does not answer" for a database that does not exist and for a refused user; a traceback
    for redis+cluster:// pointed at a server that is not a cluster."""
    base = mysql_url.rsplit("/", 1)[0]
    r = redis.Redis.from_url(redis_url)
    port = r.connection_pool.connection_kwargs.get("port", 6379)
    r.close()
    cases: list[tuple[dict[str, str], tuple[str, ...]]] = [
        (
            {"REDPACKET_DATABASE_URL": f"{base}/no_such_database", "REDPACKET_REDIS_URL": redis_url},
            ("has no database 'no_such_database'",),
        ),
        (
            {
                "REDPACKET_DATABASE_URL": base.replace("root@", "nobody:wrong@") + "/x",
                "REDPACKET_REDIS_URL": redis_url,
            },
            ("refused the user and password", "Access denied for user 'nobody'"),
        ),
        (
            {
                "REDPACKET_REDIS_URL": f"redis+cluster://127.0.0.1:{port}",
                "REDPACKET_QUEUE_REDIS_URL": redis_url,
                "REDPACKET_DATABASE_URL": mysql_url,
            },
            ("is not a cluster", "redis:// for one server"),
        ),
    ]
    for env, words in cases:
        assert_one_line_error(redpacket("reconcile", REDPACKET_DATA_DIR=str(tmp_path), **env), 1, *words)


def test_a_command_that_reads_never_makes_an_empty_ledger(tmp_path: Path) -> None:
    """Before: `redpacket reconcile` where there was no database made a fresh SQLite file and printed
    `reconciled: no difference`, exit 0 — a false all-clear."""
    for command in ("reconcile", "blocks", "recover"):
        args = (command, "1") if command == "recover" else (command,)
        line = assert_one_line_error(redpacket(*args, REDPACKET_DATA_DIR=str(tmp_path / "data")), 1)
        assert "no database at" in line and command in line, line
    assert not (tmp_path / "data").exists()  # nothing made: no SQLite, no Valkey
    named = tmp_path / "elsewhere" / "ledger.sqlite3"  # a SQLite URL of its own: the same
    env = {"REDPACKET_DATABASE_URL": f"sqlite:///{named}", "REDPACKET_DATA_DIR": str(tmp_path / "data")}
    assert "no database at" in assert_one_line_error(redpacket("reconcile", **env), 1)
    assert not named.exists() and not (tmp_path / "data").exists()


async def test_throttles_are_listed_lifted_and_never_scored_twice(core: Core) -> None:
    """Before: `redpacket blocks` said `0 blocked` while a user was throttled; every run of the detector
    (every 10 s, over a minute) throttled them again from the same attempt, and after `--lift` the old
    attempt throttled them once more."""
    now = now_ms() - 40_000  # the detector's runs below, each 10 s later, all before the lift

    async def fast_grabs(user: int, packets: range, at: int) -> None:
        rows = [[user, 1, packet, 5, "", at] for packet in packets]  # 5 ms after the packet showed
        await core.redis.xadd(keys.grab_attempts(), {"a": msgpack.packb(rows)})

    await fast_grabs(7, range(1), now)
    first = await run_detector(core, now=now)
    assert {u: d.action for u, d in first.items()} == {7: "throttle"}
    listed = await list_blocks(core)
    assert [(b.user, b.action) for b in listed] == [(7, "throttle")] and "faster than" in listed[0].reasons
    assert await run_detector(core, now=now + 10_000) == {}  # the same attempt, read again: nothing new
    await fast_grabs(7, range(1, 3), now + 15_000)  # three fast grabs in the minute now: a block
    escalated = await run_detector(core, now=now + 20_000)
    assert {u: d.action for u, d in escalated.items()} == {7: "block"}
    assert [(b.user, b.action) for b in await list_blocks(core)] == [(7, "block")]  # listed once
    assert await lift(core, 7)
    assert await list_blocks(core) == []
    assert await run_detector(core, now=now + 30_000) == {}  # its attempts were forgiven with the lift
    later = now_ms() + 1
    await fast_grabs(7, range(3, 4), later)  # a new fast grab after the lift counts again
    assert {u: d.action for u, d in (await run_detector(core, now=later)).items()} == {7: "throttle"}


def test_ctrl_c_of_up_stops_the_valkey_last(tmp_path: Path) -> None:
    """Before: the terminal's Ctrl-C (SIGINT to the whole foreground process group) reached the embedded
    Valkey with `up`, which then warned at every exit of a lost pub/sub connection and a failed drain."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "server", "up", "--port", "0"],
        env=child_env(REDPACKET_DATA_DIR=str(tmp_path / "data")),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # a terminal's foreground group of its own
    )
    try:
        assert proc.stdout is not None
        url = hub_url(proc.stdout)
        with urllib.request.urlopen(f"{url}/healthz", timeout=60) as ready:  # serving: pub/sub, drain
            assert ready.status == 200
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert proc.returncode == 0, out
    noisy = [
        line for line in out.splitlines() if " WARNING " in line or " ERROR " in line or "Traceback" in line
    ]
    assert noisy == [], out
    assert not (tmp_path / "data" / "valkey.json").exists()  # the Valkey was stopped, last


def test_up_beside_a_backend_says_what_works_instead(tmp_path: Path) -> None:
    """Before: with REDPACKET_JWT_PUBLIC_KEY set, up still offered `try: curl … /api/login`, which answers
    `disabled`."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    pem = (
        ec.generate_private_key(ec.SECP256R1())
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        .decode()
    )
    said: list[str] = []
    with redpacket_up(tmp_path / "data", env={"REDPACKET_JWT_PUBLIC_KEY": pem}, said=said) as (url, _):
        with urllib.request.urlopen(f"{url}/healthz", timeout=60) as ready:
            assert ready.status == 200
    banner = "".join(said[:6])
    assert "/api/login" not in banner, banner
    assert "Users connect with tokens your chat backend mints" in banner, banner
