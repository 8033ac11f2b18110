"""The ``redpacket`` command as an operator meets it: mistakes end in one clear line and an exit code,
and every command on a data directory uses the embedded Valkey a running ``redpacket up`` serves."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from server.settings import Settings, child_env
from server.store import keys
from tests.clitools import assert_one_line_error, redpacket
from tests.conftest import TEST_NAMESPACE, name_deployment
from tests.hubtools import hub_process, hub_url, redpacket_up


def test_operator_mistakes_are_one_line_and_an_exit_code(
    tmp_path: Path, redis_url: str, mysql_url: str
) -> None:
    data = str(tmp_path / "data")
    ok_db, ok_redis = {"REDPACKET_DATABASE_URL": mysql_url}, {"REDPACKET_REDIS_URL": redis_url}
    cases = [
        (("serve",), {**ok_db, **ok_redis}, 2, "REDPACKET_SECRET"),
        (("blocks",), {"REDPACKET_REDIS_URL": "htp://nowhere"}, 2, "REDPACKET_REDIS_URL"),
        (("reconcile",), {"REDPACKET_DATABASE_URL": "postgres://x/y"}, 2, "REDPACKET_DATABASE_URL"),
        (("migrate",), {"REDPACKET_PORT": "eighty"}, 2, "REDPACKET_PORT"),
        (("worker", "--check"), {"REDPACKET_WORKER_METRICS_PORT": "0"}, 2, "METRICS_PORT"),
        (("migrate",), {"REDPACKET_DATABASE_URL": "mysql://root@127.0.0.1:1/x"}, 1, "does not answer"),
        (
            ("reconcile",),
            {**ok_redis, "REDPACKET_DATABASE_URL": mysql_url + "_no_such_db"},
            1,
            "Unknown database",
        ),
        (("worker",), {**ok_db, "REDPACKET_REDIS_URL": "redis://127.0.0.1:1/0"}, 1, "Redis at"),
        # A ledger in use, named by mistake: bench credit undoes credits between its phases.
        (("bench", "credit"), {**ok_db, **ok_redis}, 2, "`bench` in its name"),
        (("bench", "credit", "--galera"), {**ok_db, **ok_redis}, 2, "`bench` in its name"),
        (("blocks",), {**ok_db, "REDPACKET_REDIS_URL": "redis://127.0.0.1:1/0"}, 1, "Redis at"),
        (("recover", "0"), {**ok_db, **ok_redis}, 2, "no packet"),
        (
            ("serve", "--port", "0"),
            {
                "REDPACKET_SECRET": "s" * 32,
                **ok_redis,
                "REDPACKET_DATABASE_URL": "mysql://root@127.0.0.1:1/x",
            },
            1,
            "MySQL server on 127.0.0.1:1 does not answer",
        ),
        (("serve", "--port", "0"), {"REDPACKET_SECRET": "short", **ok_db, **ok_redis}, 2, "at least 32"),
        (
            ("serve", "--port", "0"),
            {"REDPACKET_JWKS_URL": "ftp://x", **ok_db, **ok_redis},
            2,
            "must be https",
        ),
        (
            ("serve", "--port", "0"),
            {"REDPACKET_JWT_PUBLIC_KEY": "/no/such/key.pem", **ok_db, **ok_redis},
            2,
            "neither PEM text nor a readable file",
        ),
        (
            ("serve", "--port", "0"),
            {
                "REDPACKET_JWT_PUBLIC_KEY": "-----BEGIN PUBLIC KEY-----\nnot a key\n-----END PUBLIC KEY-----",
                **ok_db,
            },
            2,
            "does not hold a PEM public key",
        ),
        (
            ("serve", "--port", "0"),
            {"REDPACKET_JWT_ALGORITHMS": "HS256,RS256", **ok_db, **ok_redis},
            2,
            "never both",
        ),
        # The standard OpenTelemetry variables, checked as ours are (server.tracing).
        (("worker",), {**ok_db, **ok_redis, "OTEL_TRACES_EXPORTER": "zipkin"}, 2, "OTEL_TRACES_EXPORTER"),
        (
            ("serve", "--port", "0"),
            {
                "REDPACKET_SECRET": "s" * 32,
                **ok_db,
                **ok_redis,
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            },
            2,
            "http/protobuf",
        ),
        (("up", "--port", "0"), {"REDPACKET_CONSOLE_KEY": "short"}, 2, "REDPACKET_CONSOLE_KEY"),
    ]
    for args, env, code, word in cases:
        assert_one_line_error(redpacket(*args, REDPACKET_DATA_DIR=data, **env), code, word)
    # A packet that is not there: exit 2, as `verify` says of it (the database's migrations may log first).
    missing = redpacket("recover", str(2**62), REDPACKET_DATA_DIR=data, **ok_db, **ok_redis)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr, missing.stderr
    assert missing.stderr.splitlines()[-1].startswith(f"redpacket: packet {2**62}: "), missing.stderr


def test_a_misspelt_setting_or_storage_not_named_is_refused_before_anything_starts(
    tmp_path: Path, redis_url: str, mysql_url: str
) -> None:
    """A misspelt REDPACKET_ name would leave its setting at its default (the demo's storage, websockets
    open to every site), and ``serve`` / ``worker`` with no storage named would each keep money of their
    own: refused in one line (exit 2), with nothing made in the data directory."""
    data = tmp_path / "data"
    secret, ok_db, ok_redis = (
        {"REDPACKET_SECRET": "s" * 32},
        {"REDPACKET_DATABASE_URL": mysql_url},
        {"REDPACKET_REDIS_URL": redis_url},
    )
    serve = ("serve", "--port", "0")
    cases = [
        (
            serve,
            {**secret, **ok_redis, "REDPACKET_DATABSE_URL": mysql_url},
            "did you mean REDPACKET_DATABASE_URL?",
        ),
        (("worker",), {**ok_db, "REDPACKET_REDIS_ULR": redis_url}, "did you mean REDPACKET_REDIS_URL?"),
        (serve, {**secret, **ok_db, **ok_redis, "REDPACKET_ALLOWED_ORIGIN": "https://a.example"}, "ORIGINS?"),
        (
            ("migrate",),
            {"REDPACKET_NOTHING_LIKE_IT": "1", "REDPACKET_ZZZ": "2"},
            "not a setting; so are REDPACKET_ZZZ",
        ),
        (serve, {**secret, **ok_redis}, "REDPACKET_DATABASE_URL is not set"),
        (("worker",), ok_redis, "REDPACKET_DATABASE_URL is not set"),
        (serve, {**secret, **ok_db}, "REDPACKET_REDIS_URL=embedded"),
        (("worker",), ok_db, "REDPACKET_REDIS_URL=embedded"),
    ]
    for args, env, word in cases:
        assert_one_line_error(redpacket(*args, REDPACKET_DATA_DIR=str(data), **env), 2, word)
    assert not data.exists()  # no SQLite file, no embedded Valkey


def test_serve_takes_the_embedded_valkey_and_a_sqlite_file_asked_for_by_name(tmp_path: Path) -> None:
    sqlite = tmp_path / "ledger.sqlite3"
    proc = subprocess.Popen(
        [sys.executable, "-m", "server", "serve", "--port", "0"],
        env=child_env(
            REDPACKET_DATA_DIR=str(tmp_path / "data"),
            REDPACKET_REDIS_URL="embedded",
            REDPACKET_DATABASE_URL=f"sqlite:///{sqlite}",
            REDPACKET_SECRET="s" * 32,
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        url = hub_url(proc.stdout)
        with urllib.request.urlopen(f"{url}/healthz", timeout=30) as r:
            assert json.loads(r.read()) == {"ok": True}
        assert sqlite.exists() and (tmp_path / "data").is_dir()  # the named file, the data dir's Valkey
        said = [proc.stdout.readline() for _ in range(2)]
        assert said[1].strip() == "grab durability aof (REDPACKET_GRAB_DURABILITY)", said
    finally:
        proc.terminate()
        proc.communicate(timeout=60)


def test_a_busy_port_is_one_line(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = redpacket("up", "--port", str(port), REDPACKET_DATA_DIR=str(tmp_path / "data"))
    line = assert_one_line_error(done, 1, f"127.0.0.1:{port}", "--port")
    assert "in use" in line


def test_an_untested_uvicorn_is_one_line(tmp_path: Path) -> None:
    """The hub's HTTP side builds on uvicorn's httptools protocol (server.hub.handshake.check_uvicorn): on
    a uvicorn older than it was tested with, up and serve refuse in one line before anything starts."""
    starts = (
        "import sys, uvicorn; uvicorn.__version__ = '0.30.0'; from server.cli import main; main(sys.argv[1:])"
    )
    done = subprocess.run(
        [sys.executable, "-c", starts, "up", "--port", "0"],
        env=child_env(REDPACKET_DATA_DIR=str(tmp_path / "data")),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert_one_line_error(done, 1, "uvicorn", "0.30.0")


def test_help_lists_every_command_with_help_and_no_markup() -> None:
    top = redpacket("--help")
    assert top.returncode == 0 and "``" not in top.stdout
    for command in ("up", "serve", "worker", "migrate", "reconcile", "blocks", "recover", "bench"):
        assert re.search(rf"^    {command}\b", top.stdout, re.MULTILINE), command
    assert "--lift USER  lift the block" in redpacket("blocks", "--help").stdout
    # Each command's own page starts with what the list says of it.
    assert (
        "\nCheck every cent; print a report; exit 1 on any difference.\n"
        in redpacket("reconcile", "--help").stdout
    )
    up = redpacket("up", "--help").stdout
    assert "--host HOST  address to listen on" in up and "--port PORT  port to listen on" in up
    # Every positional argument and every flag docs/load.md names is described (they were not).
    assert re.search(
        r"PACKET_ID\s+a packet whose Redis state to rebuild", redpacket("recover", "--help").stdout
    )
    load = redpacket("load", "--help").stdout
    for flag in ("--send-every", "--reaction-ms", "--chat-every", "--hub-metrics", "--worker-metrics"):
        assert re.search(rf"{flag} \S+\n?\s+\w", load), flag


def _blocked(r: redis.Redis, user: int, until: int, why: str, namespace: str = TEST_NAMESPACE) -> None:
    """What the bot detector writes for a block (``server.live.bots.apply``), written from outside."""
    keys.claim(namespace)
    try:
        for n in range(keys.SHARDS):
            r.hset(keys.shard_gate(n), f"b:{user}", until)
        r.zadd(keys.blocks(), {str(user): until})
        r.hset(keys.block_reasons(), str(user), why)
    finally:
        keys.release()


def _still_blocked(r: redis.Redis, user: int, namespace: str = TEST_NAMESPACE) -> bool:
    keys.claim(namespace)
    try:
        return bool(r.hexists(keys.shard_gate(0), f"b:{user}") or r.zscore(keys.blocks(), str(user)))
    finally:
        keys.release()


def test_blocks_shows_deadlines_as_dates(redis_url: str, mysql_url: str, tmp_path: Path) -> None:
    asyncio.run(name_deployment(mysql_url))  # the namespace the command reads from the database
    r = redis.Redis.from_url(redis_url)
    try:
        r.flushdb()
        until = int(time.time() * 1000) + 630_000
        _blocked(r, 42, until, "grabs faster than a human")
        env = {
            "REDPACKET_REDIS_URL": redis_url,
            "REDPACKET_DATABASE_URL": mysql_url,
        }
        shown = redpacket("blocks", **env)
        assert shown.returncode == 0, shown.stderr
        line = next(x for x in shown.stdout.splitlines() if x.startswith("user 42"))
        assert time.strftime("%Y-%m-%d", time.gmtime(until / 1000)) in line and " UTC (in 10 min " in line
        assert str(until) not in line and "grabs faster than a human" in line
        assert "user 42: unblocked" in redpacket("blocks", "--lift", "42", **env).stdout
        assert not _still_blocked(r, 42)
    finally:
        r.flushdb()
        r.close()


# -- the embedded default: one Valkey per data directory -----------------------------------------------------


@pytest.fixture
def up(tmp_path: Path) -> Iterator[tuple[Path, subprocess.Popen[str]]]:
    with redpacket_up(tmp_path / "data") as (url, proc):
        # Answered once the hub has started (its database migrated): the banner comes before that.
        with urllib.request.urlopen(f"{url}/healthz", timeout=60) as ready:
            assert ready.status == 200
        yield tmp_path / "data", proc


def _state(data: Path) -> dict[str, object]:
    return json.loads((data / "valkey.json").read_text())  # type: ignore[no-any-return]


def test_commands_beside_a_running_up_use_its_valkey(up: tuple[Path, subprocess.Popen[str]]) -> None:
    data, proc = up
    state = _state(data)
    live = redis.Redis.from_url(str(state["url"]))
    try:
        with sqlite3.connect(data / "redpacket.sqlite3") as ledger:  # the deployment's own namespace
            (namespace,) = ledger.execute("SELECT id FROM deployment").fetchone()
        _blocked(live, 2, int(time.time() * 1000) + 600_000, "a test block", namespace)
        env = {"REDPACKET_DATA_DIR": str(data)}
        listed = redpacket("blocks", **env)
        assert listed.returncode == 0 and "user 2 blocked until" in listed.stdout, (
            listed.stdout + listed.stderr
        )
        assert "user 2: unblocked" in redpacket("blocks", "--lift", "2", **env).stdout
        assert not _still_blocked(live, 2, namespace)  # lifted in the server `up` uses
        # The live server's files are untouched, and it is the only one that ever served them.
        assert _state(data) == state
        assert (data / "valkey" / "valkey.conf").exists()
        assert live.ping()
        # A second `up` on the same directory refuses, in one line.
        again = redpacket("up", "--port", "0", **env)
        assert_one_line_error(again, 1, "in use by `redpacket up`", str(proc.pid))
    finally:
        live.close()
    # The database-only command starts no Valkey at all.
    fresh = data.parent / "fresh"
    assert redpacket("migrate", REDPACKET_DATA_DIR=str(fresh)).returncode == 0
    assert not (fresh / "valkey").exists() and not (fresh / "valkey.json").exists()
    # Reconciliation reads what Redis told grabbers too: on a directory of its own, its own Valkey.
    done = redpacket("reconcile", REDPACKET_DATA_DIR=str(fresh))
    assert done.returncode == 0
    assert not (fresh / "valkey.json").exists()  # stopped with the command
    # What it is doing, as it goes (a big ledger takes minutes): on stderr, the report on stdout.
    said = [line for line in done.stderr.splitlines() if line.startswith("reconcile: ")]
    assert [re.sub(r" \(\d+\.\d s\)$", "", line) for line in said] == [
        "reconcile: reading the ledger (one snapshot)",
        "reconcile: read 0 accounts and 0 packets",
        "reconcile: comparing",
    ], done.stderr


def test_a_valkey_orphaned_by_a_killed_up_is_shut_down_before_another_opens_its_files(
    up: tuple[Path, subprocess.Popen[str]],
) -> None:
    data, proc = up
    state = _state(data)
    orphan = int(state["valkey_pid"])  # type: ignore[call-overload]
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    os.kill(orphan, 0)  # still running: its parent died without stopping it
    done = redpacket("blocks", REDPACKET_DATA_DIR=str(data))
    assert done.returncode == 0, done.stderr
    with pytest.raises(ProcessLookupError):
        for _ in range(100):  # the orphan was shut down (and reaped by init); bounded
            os.kill(orphan, 0)
            time.sleep(0.05)
    assert not (data / "valkey.json").exists()  # the command's own Valkey stopped with it


async def test_serve_check_asks_the_hub_on_this_hosts_port(hub_settings: Settings) -> None:
    """The image's HEALTHCHECK (``serve --check``): 0 and "healthy" while the hub on REDPACKET_PORT answers
    /healthz, 1 and why once it is gone."""

    async def check(port: int) -> subprocess.CompletedProcess[str]:
        env = child_env(REDPACKET_PORT=str(port))
        argv = [sys.executable, "-m", "server", "serve", "--check"]
        return await asyncio.to_thread(
            subprocess.run, argv, env=env, capture_output=True, text=True, timeout=60
        )

    async with hub_process(hub_settings) as hub:
        port = int(hub.http.rsplit(":", 1)[1])
        done = await check(port)
        assert done.returncode == 0 and done.stdout.startswith("healthy:"), done
        assert hub.process is not None
        hub.process.terminate()
        await asyncio.to_thread(hub.process.wait, 60)
        done = await check(port)
        assert done.returncode == 1 and done.stdout.startswith("unhealthy: no hub answers"), done
