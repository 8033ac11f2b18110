"""docs/openapi.json (the HTTP API) and docs/asyncapi.yaml (the websocket protocol) read without a hub: both
are valid documents whose schemas are JSON Schema 2020-12 and whose references resolve, every operation is
whole, every example validates against its schema, their error codes are ``server.errors``' and their
close codes the hub's, and every route the app mounts is described. (Every example sent to live hubs:
``tests/test_apidocs.py``.)"""

from __future__ import annotations

import re
from typing import Any

import pytest
from jsonschema import Draft7Validator, Draft202012Validator
from starlette.routing import Mount, Route, WebSocketRoute

from server import errors
from server.hub import protocol
from server.hub.app import create_app, http_error
from server.hub.console import api as console_api
from server.hub.operations import operations_app
from server.settings import Settings
from tests.apidoctools import (
    ASYNCAPI,
    OPENAPI,
    asyncapi_schemas,
    at,
    check,
    deref,
    examples,
    openapi_schemas,
    params_of,
    walk,
)
from tests.repofiles import ROOT

METHODS = ("get", "put", "post", "delete", "patch")


@pytest.mark.parametrize("doc", [OPENAPI, ASYNCAPI], ids=["openapi", "asyncapi"])
def test_the_documents_are_valid_and_every_reference_resolves(doc: dict[str, Any]) -> None:
    assert doc.get("openapi", "3.1.0").startswith("3.1.") and doc.get("asyncapi", "3.0.0") == "3.0.0"
    pointers = list(openapi_schemas() if doc is OPENAPI else asyncapi_schemas())
    assert len(pointers) > 30
    for pointer in pointers:
        Draft202012Validator.check_schema(at(doc, pointer))
        if doc is ASYNCAPI:  # whose default schema format is a superset of JSON Schema draft 7
            Draft7Validator.check_schema(at(doc, pointer))
    for pointer, node in walk(doc):
        if pointer.endswith("/$ref"):
            assert isinstance(node, str) and node.startswith("#/"), pointer
            at(doc, node)  # raises if it does not resolve
        if isinstance(node, dict) and "$ref" in node:
            assert len(node) == 1, f"{pointer}: draft 7 ignores what stands beside a $ref"


def test_every_openapi_operation_is_whole() -> None:
    ids = []
    for path, item in OPENAPI["paths"].items():
        for method, op in item.items():
            assert method in METHODS, (path, method)
            ids.append(op["operationId"])
            declared = {p["name"] for p in params_of(op) if p["in"] == "path"}
            assert declared == set(re.findall(r"{(\w+)}", path)), (path, method)
            assert "200" in op["responses"], (path, method)
            for status, response in op["responses"].items():
                assert "description" in deref(OPENAPI, response), (path, method, status)
            for need in op.get("security", OPENAPI["security"]):
                assert set(need) <= set(OPENAPI["components"]["securitySchemes"])
    assert len(ids) == len(set(ids))


def test_every_asyncapi_operation_names_messages_of_its_channel() -> None:
    for name, op in ASYNCAPI["operations"].items():
        channel = op["channel"]["$ref"]
        assert op["action"] in ("send", "receive"), name
        for ref in [*op["messages"], *op.get("reply", {}).get("messages", [])]:
            assert ref["$ref"].startswith(f"{channel}/messages/"), (name, ref)
    sent = {r["$ref"] for op in ASYNCAPI["operations"].values() for r in op["messages"]}
    replied = {
        r["$ref"] for op in ASYNCAPI["operations"].values() for r in op.get("reply", {}).get("messages", [])
    }
    assert {f"#/channels/hub/messages/{m}" for m in ASYNCAPI["components"]["messages"]} == sent | replied


def test_every_object_the_asyncapi_document_describes_is_named() -> None:
    """Code generators name a model by its schema's ``title``: without one, AsyncAPI's modelina made 61 of
    67 models ``AnonymousSchema_N``. Every object schema, payloads and the objects inside them, has one
    (the websocket binding's query and headers are no model)."""
    bindings = ("/channels/hub/bindings/ws/query", "/channels/hub/bindings/ws/headers")
    unnamed = [
        pointer
        for pointer, node in walk(ASYNCAPI)
        if isinstance(node, dict)
        and (node.get("type") == "object" or "properties" in node)
        and "title" not in node
        and "/examples" not in pointer
        and pointer not in bindings
    ]
    assert unnamed == []


@pytest.mark.parametrize("doc", [OPENAPI, ASYNCAPI], ids=["openapi", "asyncapi"])
def test_every_example_validates_against_its_schema(doc: dict[str, Any]) -> None:
    found = list(examples(doc))
    assert len(found) > 20
    for pointer, _, value in found:
        check(doc, pointer, value)


def error_code_enums(doc: dict[str, Any]) -> list[tuple[set[str], set[str]]]:
    """The listed codes and the ledger's of each error ``code``: an ``enum``, or (open, as the OpenAPI
    document's: a code added since is a string a generated client still reads) ``anyOf`` the list and any
    string."""
    found = []
    for pointer, node in walk(doc):
        if (
            pointer.endswith("/error/properties/code")
            or pointer == "/components/schemas/Error/properties/code"
        ):
            branches = [deref(doc, b) for b in node.get("anyOf", [node])]
            listed = [b for b in branches if "enum" in b]
            assert len(listed) == 1 and all(b in listed or b == {"type": "string"} for b in branches), pointer
            found.append((set(listed[0]["enum"]), set(node.get("x-ledger-codes", []))))
    return found


@pytest.mark.parametrize("doc", [OPENAPI, ASYNCAPI], ids=["openapi", "asyncapi"])
def test_the_error_codes_are_the_codes_of_server_errors(doc: dict[str, Any]) -> None:
    enums = error_code_enums(doc)
    assert len(enums) == 1
    sent, ledger_only = enums[0]
    # Open in both (docs/integration.md, "Versions"): a code added since is a string a client still reads.
    pointer = "/components/schemas/Error/properties/" + (
        "error/properties/code" if doc is OPENAPI else "code"
    )
    assert {"type": "string"} in at(doc, pointer)["anyOf"]
    assert sent == set(errors.WIRE_CODES)
    assert sent | ledger_only == set(errors.ALL_CODES)


# Close codes a client never sees as a close: CLOSE_POLICY is sent before the upgrade (an Origin not
# allowed, a demo hub's not_local), which the client gets as HTTP 403 (the channel's description says so).
# Sent by websockets' parser or by the hub's protocol through websockets (``fail``), not by a close() of
# the hub's: 1009 (a frame over the size limit), 1011 (no pong in time), 1007 (text not UTF-8). (1008 is
# both CLOSE_POLICY, before the upgrade, and CLOSE_FLOOD after it: documented for the second.)
BY_THE_LAYERS_BELOW = {protocol.CLOSE_TOO_BIG, 1011, 1007}


def test_the_close_codes_are_the_hubs() -> None:
    """Every close code the hub's code sends (a protocol.CLOSE_* it uses, or a number it closes with),
    documented, and no other: protocol.py's CLOSE_HEARTBEAT (4002) is defined but sent by nobody."""
    constants = {n: v for n, v in vars(protocol).items() if n.startswith("CLOSE_") and isinstance(v, int)}
    sources = [p.read_text() for p in (ROOT / "server").rglob("*.py") if p.name != "protocol.py"]
    used = {v for n, v in constants.items() if any(re.search(rf"\b{n}\b", s) for s in sources)}
    used |= {int(c) for s in sources for c in re.findall(r"(?:close|send_close)\((\d{4})\b", s)}
    used |= BY_THE_LAYERS_BELOW
    documented = [c["code"] for c in ASYNCAPI["x-close-codes"]]
    assert sorted(documented) == sorted(used)
    table = (ROOT / "docs" / "protocol.md").read_text().split("## Close codes", 1)[1].split("\n## ", 1)[0]
    assert sorted(documented) == sorted(int(c) for c in re.findall(r"^\| (\d{4}) \|", table, re.M))


def test_every_route_the_app_mounts_is_described() -> None:
    """The hub's port (the console there too, when asked) and the operations listener's."""
    settings = Settings(secret="x" * 32, console_key="k" * 32, console_on_hub_port=True)
    ops = operations_app(settings, lambda: b"", console_api.routes(), http_error)
    pages = {"": "/", "/client": "/", "/console": "/console/"}  # static files, described by the page's path
    for route in [*create_app(settings).routes, *ops.routes]:
        if isinstance(route, WebSocketRoute):
            assert route.path == ASYNCAPI["channels"]["hub"]["address"]
        elif isinstance(route, Mount):
            assert route.path in pages, route.path
            assert f"`{route.path}/" in OPENAPI["paths"][pages[route.path]]["get"]["description"]
        else:
            assert isinstance(route, Route)
            path = "/console/" if route.path == "/console" else route.path  # (its redirect to the page)
            for method in (route.methods or set()) - {"HEAD"}:
                assert method.lower() in OPENAPI["paths"].get(path, {}), f"{method} {route.path}"


def test_the_console_routes_are_on_the_operations_listener() -> None:
    """Every console operation says where it is served: not where a client generated for the hub's port
    would call it."""
    for path, method in [(p, m) for p, item in OPENAPI["paths"].items() for m, op in item.items()]:
        op = OPENAPI["paths"][path][method]
        assert ("console" in op["tags"]) == ("servers" in op), (method, path)
        assert ("console" in op["tags"]) == (path.startswith(("/api/console/", "/console/"))), (method, path)
