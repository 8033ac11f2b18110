"""What ``Settings.check`` refuses before anything starts, each refusal naming its setting: a URL or port that
cannot be read, a key or secret too short or given twice as its own previous value, and the dev login and demo
money anywhere but on a hub alone on this machine."""

from __future__ import annotations

from typing import Any

import pytest

from server.settings import Settings
from tests.chatbackend import KEY, NEW, OLD


def test_settings_check_names_the_setting() -> None:
    with pytest.raises(ValueError, match="REDPACKET_REDIS_URL"):
        Settings(redis_url="localhost:6379").check()
    with pytest.raises(ValueError, match="REDPACKET_WORKER_METRICS_PORT"):
        Settings(worker_metrics_port=70_000).check()
    Settings(redis_url="redis://h:1/0", database_url="sqlite:///x").check()


def test_a_previous_value_must_be_a_real_second_value() -> None:
    for bad in (
        dict(service_key=NEW, service_key_previous=NEW),
        dict(service_key=NEW, service_key_previous="short"),
        dict(service_key_previous=OLD),
        dict(webhook_urls="http://127.0.0.1:9/h", webhook_secret=NEW, webhook_secret_previous=NEW),
    ):
        with pytest.raises(ValueError, match="_PREVIOUS"):
            Settings(**bad).check()  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "refused"),
    [
        ({"host": "127.0.0.1"}, None),
        ({"host": "::1"}, None),
        ({"host": "0.0.0.0"}, "only on a hub listening on this machine alone"),
        ({"host": "10.0.0.7"}, "only on a hub listening on this machine alone"),
        ({"service_key": KEY}, "never beside a chat backend"),
        ({"jwks_url": "https://auth.example/jwks.json", "secret": ""}, "never beside a chat backend"),
    ],
)
def test_dev_login_and_demo_money_are_for_loopback_without_a_backend(
    changes: dict[str, Any], refused: str | None
) -> None:
    s = Settings(secret="s" * 32, dev_login=True, demo_topup=True).replace(**changes)
    if refused is None:
        s.check()
        return
    with pytest.raises(ValueError, match=refused):
        s.check()
    with pytest.raises(ValueError, match=refused):  # either one alone
        s.replace(dev_login=False).check()


def test_a_service_key_shorter_than_32_characters_is_refused() -> None:
    with pytest.raises(ValueError, match="SERVICE_KEY is too short"):
        Settings(secret="s" * 32, service_key="x").check()
    Settings(secret="s" * 32, service_key="x" * 32).check()


@pytest.mark.parametrize(
    "changes",
    [
        {"console_key": "c" * 31, "metrics_port": 9100},  # too short
        {"console_key": KEY, "service_key": KEY, "metrics_port": 9100},  # the chat backend's key
        {"console_key": "s" * 32, "metrics_port": 9100},  # the token secret
        {"console_key": "c" * 32},  # nowhere to serve it: not silently on the public port
    ],
)
def test_a_console_key_is_the_operators_own_and_served_apart(changes: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="REDPACKET_CONSOLE_KEY"):
        Settings(secret="s" * 32).replace(**changes).check()


def test_a_console_key_with_a_place_to_serve_it_is_taken() -> None:
    Settings(secret="s" * 32, console_key="c" * 32, metrics_port=9100).check()
    Settings(secret="s" * 32, console_key="c" * 32, console_on_hub_port=True).check()
