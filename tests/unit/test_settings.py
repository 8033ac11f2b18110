"""The settings as declared: every one read from its environment variable, held to its bounds, and the
table of docs/configuration.md the declarations rendered. In-process, no services."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from server.durability import Durability
from server.settingdocs import settings_table
from server.settingfields import env_name
from server.settings import Settings
from tests.repofiles import ROOT

CONFIGURATION = ROOT / "docs" / "configuration.md"
NUMBERS = [f for f in dataclasses.fields(Settings) if type(f.default) in (int, float)]


def documented_table() -> str:
    text = CONFIGURATION.read_text()
    start = text.index("| variable | default | meaning |")
    return text[start : text.index("\n\n", start) + 1]


def test_the_documented_table_is_the_declarations() -> None:
    assert documented_table() == settings_table(), (
        "docs/configuration.md's table differs from the declarations in server/settingfields.py: paste in"
        ' the output of `python -c "from server.settingdocs import settings_table as t; print(t())"`'
    )


def _other(f: dataclasses.Field[Any]) -> tuple[str, object]:
    """A value unlike the default, as the environment writes it and as the settings hold it."""
    default = f.default
    if isinstance(default, bool):
        return ("0", False) if default else ("1", True)
    if isinstance(default, int | float):
        return str(default + 3), default + 3
    if isinstance(default, Path):
        return "/elsewhere", Path("/elsewhere")
    return default + "x", default + "x"


@pytest.mark.parametrize("f", dataclasses.fields(Settings), ids=lambda f: f.name)
def test_every_setting_is_read_from_its_variable(f: dataclasses.Field[Any]) -> None:
    text, value = _other(f)
    got = Settings.from_env({env_name(f.name): text})
    assert getattr(got, f.name) == value
    assert got == dataclasses.replace(Settings(), **{f.name: value})  # and nothing else


def test_a_child_process_reads_the_very_same_settings() -> None:
    """``to_env`` (what the worker hands its reconciliation's child process) gives every setting back
    through ``from_env``, each one changed from its default, and the defaults too."""
    changed = Settings(**{f.name: _other(f)[1] for f in dataclasses.fields(Settings)})
    for s in (changed, Settings()):
        env = s.to_env()
        assert set(env) == {env_name(f.name) for f in dataclasses.fields(Settings)}
        assert Settings.from_env(env) == s


def test_the_stream_ttl_has_its_variable() -> None:
    assert Settings.from_env({"REDPACKET_STREAM_TTL_SECONDS": "60"}).stream_ttl_seconds == 60


def test_empty_numbers_are_their_defaults_and_text_is_taken_as_written() -> None:
    env = {env_name(f.name): "" for f in dataclasses.fields(Settings)}
    got = Settings.from_env(env)
    for f in dataclasses.fields(Settings):
        if type(f.default) in (bool, int, float):
            assert getattr(got, f.name) == f.default, f.name
    assert got.host == "" and got.queue_name == "" and got.data_dir == Path("")
    assert Settings.from_env({"REDPACKET_DEV_LOGIN": "2"}).dev_login is True
    with pytest.raises(ValueError, match="REDPACKET_PORT must be an integer, got 'eighty'"):
        Settings.from_env({"REDPACKET_PORT": "eighty"})
    with pytest.raises(ValueError, match="REDPACKET_MSGS_PER_SECOND must be a number, got 'fast'"):
        Settings.from_env({"REDPACKET_MSGS_PER_SECOND": "fast"})
    with pytest.raises(ValueError, match="REDPACKET_BATCH_REDIS must be an integer"):
        Settings.from_env({"REDPACKET_BATCH_REDIS": "yes"})


@pytest.mark.parametrize("f", NUMBERS, ids=lambda f: f.name)
def test_every_number_is_held_to_its_declared_bounds(f: dataclasses.Field[Any]) -> None:
    Settings().replace(**{f.name: f.default}).check()
    for bad in (-1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=f"{env_name(f.name)} must be a"):
            Settings().replace(**{f.name: bad}).check()
    least, most = f.metadata["least"], f.metadata["most"]
    if least == 0:
        Settings().replace(**{f.name: 0}).check()
    elif least is not None:
        Settings().replace(**{f.name: least}).check()
        with pytest.raises(ValueError, match=f"{env_name(f.name)} must be a number {least} or more"):
            Settings().replace(**{f.name: least - 1}).check()
    else:
        with pytest.raises(ValueError, match=f"{env_name(f.name)} must be a number more than 0"):
            Settings().replace(**{f.name: 0}).check()
    if most is not None:
        Settings().replace(**{f.name: most}).check()
        what = "a port number" if f.name.endswith("port") else "a number"
        with pytest.raises(ValueError, match=f"{env_name(f.name)} must be {what}, {least} to {most}"):
            Settings().replace(**{f.name: most + 1}).check()


def test_durability_is_resolved_once_in_the_settings() -> None:
    # The embedded Valkey (no Redis URL) keeps grabs on its disk unless told otherwise; any other, none.
    assert Settings().durability is Durability.AOF
    assert Settings.from_env({"REDPACKET_GRAB_DURABILITY": ""}).durability is Durability.AOF
    assert Settings(redis_url="redis://h:1/0").durability is Durability.NONE
    # A copy naming the embedded server by its URL keeps aof; one of an external Redis stays none; a level
    # given with the URL is that level.
    assert Settings().replace(redis_url="redis://127.0.0.1:1/0").durability is Durability.AOF
    assert (
        Settings(redis_url="redis://h:1/0").replace(redis_url="redis://g:1/0").durability is Durability.NONE
    )
    assert Settings().replace(redis_url="redis://g:1/0", grab_durability="none").durability is Durability.NONE
    for level in Durability:
        env = {"REDPACKET_GRAB_DURABILITY": level.value, "REDPACKET_REDIS_URL": "redis://h:1/0"}
        assert Settings.from_env(env).durability is level
        assert Settings(grab_durability=level).durability is level
    with pytest.raises(ValueError, match="REDPACKET_GRAB_DURABILITY must be one of none, aof, replica"):
        Settings(grab_durability="disk").check()


def test_what_each_durability_waits_for() -> None:
    waits = {d: (d.waits, d.fsyncs, d.wants_replica, d.degrades) for d in Durability}
    assert waits == {
        Durability.NONE: (False, False, False, False),
        Durability.AOF: (True, True, False, False),
        Durability.REPLICA: (True, False, True, False),
        Durability.AOF_REPLICA: (True, True, True, True),
    }


def test_a_name_that_is_no_setting_is_refused_with_the_nearest_one() -> None:
    with pytest.raises(
        ValueError,
        match=r"^REDPACKET_DATABSE_URL is not a setting \(did you mean REDPACKET_DATABASE_URL\?\): fix",
    ):
        Settings.from_env({"REDPACKET_DATABSE_URL": "mysql://x/y"})
    with pytest.raises(ValueError, match=r"^REDPACKET_COLOUR is not a setting: fix or unset it"):
        Settings.from_env({"REDPACKET_COLOUR": "red"})
    # What is not a setting by design: the load tool's stages for Locust, the test suite's own names.
    taken = Settings.from_env(
        {"REDPACKET_LOAD_STAGES": "10:5", "REDPACKET_TEST_REDIS_URL": "redis://x", "HOME": "/"}
    )
    assert taken == Settings()


def test_the_embedded_valkey_is_named_or_left_empty() -> None:
    assert Settings(redis_url="embedded").embedded_redis and Settings().embedded_redis
    assert not Settings(redis_url="redis://127.0.0.1:6379/0").embedded_redis
    Settings(redis_url="embedded").check()
    with pytest.raises(ValueError, match="or be 'embedded'"):
        Settings(redis_url="embeded").check()


def test_a_health_check_asks_its_own_process_directly_and_reads_a_refusal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``serve --check`` / ``worker --check``: a wildcard address is asked on loopback, IPv6 in brackets;
    the environment's HTTP proxy (a container is often given the host's) is never used; a 503 is an
    answer, not a failure to connect."""
    import http.server
    import threading

    from server.probe import ask_own, own_url

    assert own_url("0.0.0.0", 8000, "/healthz") == "http://127.0.0.1:8000/healthz"
    assert own_url("::", 8000, "/healthz") == "http://127.0.0.1:8000/healthz"
    assert own_url("::1", 9108, "/metrics") == "http://[::1]:9108/metrics"
    assert own_url("10.0.0.5", 8000, "/healthz") == "http://10.0.0.5:8000/healthz"

    class Refusing(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(503)
            self.end_headers()
            self.wfile.write(b'{"error": "redis_unavailable"}')

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Refusing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        # A proxy that does not exist: asked through it, this would fail to connect.
        monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
        monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
        monkeypatch.delenv("no_proxy", raising=False)
        monkeypatch.delenv("NO_PROXY", raising=False)
        status, said = ask_own(own_url("127.0.0.1", server.server_address[1], "/healthz"), 5)
    finally:
        server.shutdown()
        server.server_close()
    assert status == 503 and "redis_unavailable" in said
