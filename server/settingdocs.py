"""docs/configuration.md's table of settings, rendered from their declarations (``server.settingfields``):
paste in the output of ``python -c "from server.settingdocs import settings_table as t; print(t())"``."""

from __future__ import annotations

from dataclasses import Field, fields
from typing import Any

from server.settingfields import SettingFields, env_name


def shown_default(f: Field[Any]) -> str:
    """A setting's default as docs/configuration.md shows it."""
    value = f.default
    if f.metadata["shown"]:
        return str(f.metadata["shown"])
    if isinstance(value, bool):
        return f"`{int(value)}`"
    if value == "":
        return "*(none)*"
    return f"`{value:g}`" if isinstance(value, float) else f"`{value}`"


def settings_table() -> str:
    """docs/configuration.md's table (markdown), one row per declaration."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for f in fields(SettingFields):
        rows.append(f"| `{env_name(f.name)}` | {shown_default(f)} | {f.metadata['help']} |")
    return "\n".join(rows) + "\n"
