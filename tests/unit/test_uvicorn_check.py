"""What the hub takes from uvicorn. The websocket side (``server.hub.wire``) is the hub's own protocol
behind uvicorn's public ``ws=`` seam: it imports nothing of uvicorn's but ``uvicorn.Config`` and
``uvicorn.server.ServerState``, what uvicorn hands every such class. The HTTP side
(``server.hub.handshake.BoundedHttp``) still subclasses uvicorn's httptools protocol: ``check_uvicorn``
starts the hub only on a uvicorn at least as new as the one it was tested with whose classes still have
every name it uses; otherwise it says in one line what is wrong. In-process, against the installed
uvicorn."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from server.hub import handshake
from server.hub.app import uvicorn_config
from server.hub.handshake import RELIED_ON, UVICORN_FROM, UnsupportedUvicorn, check_uvicorn
from server.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
TESTED = f"uvicorn>={UVICORN_FROM[0]}.{UVICORN_FROM[1]}"


def _refusal() -> str:
    with pytest.raises(UnsupportedUvicorn) as refused:
        check_uvicorn()
    message = str(refused.value)
    assert "\n" not in message
    return message


def test_the_installed_uvicorn_passes_and_pyproject_asks_for_the_one_tested_or_newer() -> None:
    check_uvicorn()
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert TESTED in dependencies  # and no upper bound: a newer one is taken when check_uvicorn passes


@pytest.mark.parametrize(
    ("module", "imports", "attributes"),
    [("wire.py", set(), set()), ("upgrade.py", {"uvicorn", "uvicorn.server.ServerState"}, {"Config"})],
)
def test_the_websocket_side_imports_nothing_private_of_uvicorn(
    module: str, imports: set[str], attributes: set[str]
) -> None:
    tree = ast.parse((ROOT / "server" / "hub" / module).read_text())
    taken = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            taken |= {a.name for a in node.names if a.name.split(".")[0] == "uvicorn"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "uvicorn":
            taken |= {f"{node.module}.{a.name}" for a in node.names}
    assert taken == imports
    used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and _on(n, "uvicorn")}
    assert used == attributes


def _on(node: ast.Attribute, name: str) -> bool:
    return isinstance(node.value, ast.Name) and node.value.id == name


def test_the_http_side_relies_on_fewer_than_twenty_names_of_uvicorns_class() -> None:
    assert len(RELIED_ON[HttpToolsProtocol]) < 20, RELIED_ON[HttpToolsProtocol]


@pytest.mark.parametrize("version", [f"{UVICORN_FROM[0]}.{UVICORN_FROM[1] - 1}.9", "0.1.0", "dev"])
def test_an_older_uvicorn_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    monkeypatch.setattr(uvicorn, "__version__", version)
    message = _refusal()
    assert message.startswith(f"uvicorn {version} is installed") and TESTED in message


def test_a_newer_uvicorn_with_every_name_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(uvicorn, "__version__", "1.2.0")
    check_uvicorn()


@pytest.mark.parametrize(
    ("cls", "name", "shown"),
    [
        (HttpToolsProtocol, "_should_upgrade", "HttpToolsProtocol"),
        (HttpToolsProtocol, "on_headers_complete", "HttpToolsProtocol"),
        (RequestResponseCycle, "more_body", "RequestResponseCycle"),
    ],
)
def test_a_name_gone_from_the_installed_classes_is_named(
    monkeypatch: pytest.MonkeyPatch, cls: type, name: str, shown: str
) -> None:
    if name in vars(cls):
        monkeypatch.delattr(cls, name)
    else:  # (assigned in __init__: an __init__ that no longer assigns it)
        monkeypatch.setattr(cls, "__init__", lambda self, *a, **k: None)
    message = _refusal()
    assert f"{shown} has no {name}, which server/hub/handshake.py uses" in message
    assert TESTED in message
    assert handshake.__name__ == "server.hub.handshake"


def test_the_hub_builds_no_uvicorn_config_on_an_older_uvicorn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(uvicorn, "__version__", "0.30.0")
    with pytest.raises(UnsupportedUvicorn):
        uvicorn_config(object(), Settings())
