"""The API documents as tests read them: docs/openapi.json (the HTTP API) and docs/asyncapi.yaml (the
websocket protocol), walked by JSON pointer, their schemas and examples found, and a value checked against
the schema at a pointer (JSON Schema 2020-12, the document's own references resolved)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import yaml
from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from tests.repofiles import ROOT

OPENAPI: dict[str, Any] = json.loads((ROOT / "docs" / "openapi.json").read_text())
ASYNCAPI: dict[str, Any] = yaml.safe_load((ROOT / "docs" / "asyncapi.yaml").read_text())


def escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def walk(node: object, at: str = "") -> Iterator[tuple[str, Any]]:
    """Every (JSON pointer, value) in a document."""
    yield at, node
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else []
    for key, value in items:
        yield from walk(value, f"{at}/{escape(str(key))}")


def at(doc: dict[str, Any], pointer: str) -> Any:
    node: Any = doc
    for part in pointer.lstrip("#").split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


def deref(doc: dict[str, Any], node: Any) -> Any:
    return at(doc, node["$ref"]) if isinstance(node, dict) and "$ref" in node else node


def params_of(op: dict[str, Any]) -> list[dict[str, Any]]:
    """An operation's parameters, each one's ``$ref`` (the shared ``Redpacket-Ids`` header) resolved."""
    return [deref(OPENAPI, p) for p in op.get("parameters", [])]


def validator(doc: dict[str, Any], pointer: str) -> Draft202012Validator:
    """A validator for the schema at ``pointer``, its ``#/…`` references resolved in ``doc``."""
    registry: Registry[Any] = Registry().with_resource(
        "urn:doc", Resource.from_contents(doc, default_specification=DRAFT202012)
    )
    return Draft202012Validator({"$ref": f"urn:doc#{pointer}"}, registry=registry)


def check(doc: dict[str, Any], pointer: str, value: object) -> None:
    problems = [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in validator(doc, pointer).iter_errors(value)
    ]
    assert not problems, f"{pointer}: {problems}\n{json.dumps(value, ensure_ascii=False)[:2000]}"


def openapi_schemas() -> Iterator[str]:
    """The pointer of every schema in the OpenAPI document."""
    for pointer, node in walk(OPENAPI):
        if re.fullmatch(r"/components/schemas/[^/]+", pointer) or (
            isinstance(node, dict) and pointer.endswith("/schema") and "/properties/" not in pointer
        ):
            yield pointer


def asyncapi_schemas() -> Iterator[str]:
    for pointer, _ in walk(ASYNCAPI):
        if re.fullmatch(r"/components/(schemas/[^/]+|messages/[^/]+/payload)", pointer) or re.fullmatch(
            r"/channels/[^/]+/bindings/ws/(query|headers)", pointer
        ):
            yield pointer


def examples(doc: dict[str, Any]) -> Iterator[tuple[str, str, object]]:
    """(the schema's pointer, the example's name, its value) of every example in a document."""
    for pointer, node in walk(doc):
        if not isinstance(node, dict):
            continue
        if "examples" in node and ("schema" in node or "payload" in node):
            schema = f"{pointer}/{'schema' if 'schema' in node else 'payload'}"
            listed = node["examples"]
            for name, ex in listed.items() if isinstance(listed, dict) else ((e["name"], e) for e in listed):
                yield schema, name, ex["value"] if "value" in ex else ex["payload"]
        if "example" in node and "schema" in node:
            yield f"{pointer}/schema", "", node["example"]
