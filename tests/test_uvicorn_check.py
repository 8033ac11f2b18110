"""``server.hub.wire.check_uvicorn``: the hub starts only on a uvicorn it was tested with, whose protocol
classes (and websockets' connection) still have what the hub's subclasses use; otherwise it says in one
line what is wrong. In-process, against the installed uvicorn and websockets."""

from __future__ import annotations

import asyncio
import tomllib
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.protocol import Protocol as WebSocketsProtocol

from server.hub.wire import UVICORN_TESTED, UnsupportedUvicorn, check_uvicorn, uvicorn_config
from server.settings import Settings

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
(LOW, HIGH) = UVICORN_TESTED
TESTED = f"uvicorn>={LOW[0]}.{LOW[1]},<{HIGH[0]}.{HIGH[1]}"


def _refusal() -> str:
    with pytest.raises(UnsupportedUvicorn) as refused:
        check_uvicorn()
    message = str(refused.value)
    assert "\n" not in message
    return message


def test_the_installed_uvicorn_passes_and_pyproject_pins_the_range_tested() -> None:
    check_uvicorn()
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert TESTED in dependencies


@pytest.mark.parametrize("version", [f"{LOW[0]}.{LOW[1] - 1}.9", f"{HIGH[0]}.{HIGH[1]}.0", "1.0.0", "dev"])
def test_another_uvicorn_version_is_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch, version: str
) -> None:
    monkeypatch.setattr(uvicorn, "__version__", version)
    message = _refusal()
    assert message.startswith(f"uvicorn {version} is installed") and TESTED in message


@pytest.mark.parametrize(
    ("cls", "name", "shown", "user"),
    [
        (WebSocketsSansIOProtocol, "send_receive_event_to_app", "WebSocketsSansIOProtocol", "wire.py"),
        (HttpToolsProtocol, "_should_upgrade", "HttpToolsProtocol", "handshake.py"),
        # Defined on websockets' base class: the server protocol uvicorn holds inherits it.
        (WebSocketsProtocol, "send_text", "websockets.server.ServerProtocol", "wire.py"),
    ],
)
def test_a_method_gone_from_the_installed_classes_is_named(
    monkeypatch: pytest.MonkeyPatch, cls: type, name: str, shown: str, user: str
) -> None:
    monkeypatch.delattr(cls, name)
    message = _refusal()
    assert f"{shown} has no {name}, which server/hub/{user} uses" in message
    assert TESTED in message


def test_state_uvicorn_no_longer_keeps_under_that_name_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    # ``queue`` is assigned in ``__init__`` alone (as are ``conn`` and ``writable``, kept here): an
    # ``__init__`` that keeps the messages under another name would leave the hub's ``listen`` reading
    # nothing.
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        self.conn = self.writable = None
        self.receive_queue = asyncio.Queue()

    monkeypatch.setattr(WebSocketsSansIOProtocol, "__init__", init)
    assert "WebSocketsSansIOProtocol has no queue, which server/hub/wire.py uses" in _refusal()


def test_the_hub_builds_no_uvicorn_config_on_another_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(uvicorn, "__version__", f"{HIGH[0]}.{HIGH[1]}.0")
    with pytest.raises(UnsupportedUvicorn):
        uvicorn_config(object(), Settings())
