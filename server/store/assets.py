"""Where the folders shipped beside the packages are: ``lua/`` (the scripts) and ``web/`` (the page)."""

from __future__ import annotations

import sys
from pathlib import Path


def asset_dir(name: str) -> Path:
    """The source tree's folder (also under an editable install), else where a wheel installs it:
    ``<prefix>/share/redpacket/<name>`` (pyproject's data-files)."""
    here = Path(__file__).resolve().parents[2] / name
    return here if here.is_dir() else Path(sys.prefix) / "share" / "redpacket" / name
