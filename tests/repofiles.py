"""The repository's own files as tests read them: where its root is, what docs/protocol.md says, the
examples docs/integration.md gives (held to what the code does), the Dockerfile's instructions and the
Grafana dashboard's panels."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
PROTOCOL = re.sub(r"\s+", " ", (ROOT / "docs" / "protocol.md").read_text())
GUIDE = ROOT / "docs" / "integration.md"
DASHBOARD = ROOT / "monitoring" / "grafana" / "dashboards" / "redpacket.json"


def read_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def dashboard_panels() -> list[dict[str, Any]]:
    """The Grafana dashboard's panels (its rows left out)."""
    return [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] != "row"]


def says(words: str) -> None:
    """docs/protocol.md says ``words`` (whitespace as in running text)."""
    assert re.sub(r"\s+", " ", words) in PROTOCOL, words


def guide_example(marker: str) -> str:
    """The example docs/integration.md gives between ``<!-- marker -->`` and ``<!-- /marker -->``."""
    m = re.search(rf"<!-- {marker} -->\n```\w*\n(.*?)```\n<!-- /{marker} -->", GUIDE.read_text(), re.DOTALL)
    assert m, f"no {marker} example in docs/integration.md"
    return m[1]


def dockerfile_instructions() -> list[tuple[str, str]]:
    """The Dockerfile's instructions in order: (the word, upper case; the rest of the line)."""
    out = []
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out
