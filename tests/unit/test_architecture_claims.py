"""docs/architecture.md names, for each money rule and each promise, the tests that fail without it. A
name that no longer exists (a test renamed, moved to another file, or deleted) would leave a rule
looking held by nothing: every test file and test named there exists, as named."""

from __future__ import annotations

import re
from pathlib import Path

from tests.repofiles import ROOT

ARCHITECTURE = ROOT / "docs" / "architecture.md"
# `test_credit.py::test_a_credit_run_twice_pays_once`, `tests/unit/test_split.py`, and `…test_name`: a
# further test of the file named just before it. A name that ends in "…" is the start of one.
REFERENCE = re.compile(r"`(?:(?:tests/)?((?:unit/)?test_\w+\.py)(?:::(test_\w+…?))?|…(test_\w+…?))")


def _file(name: str) -> Path | None:
    for where in (ROOT / "tests" / name, ROOT / "tests" / "unit" / name):
        if where.exists():
            return where
    return None


def _definition(test: str) -> str:
    """A pattern of the test's ``def`` line: the whole name, or a name that starts so (ending in "…")."""
    name = test.removesuffix("…")
    return rf"^(async )?def {name}" + ("" if name != test else r"\(")


def named_tests() -> list[tuple[str, str | None]]:
    """(test file, test in it or None) for every reference of the document, in order."""
    found: list[tuple[str, str | None]] = []
    last = ""
    for file, test, more in REFERENCE.findall(ARCHITECTURE.read_text()):
        if file:
            last = file
            found.append((file, test or None))
        elif last:
            found.append((last, more))
    return found


def test_the_architecture_names_its_tests() -> None:
    assert len(named_tests()) > 20  # (the tables are read: a reference format changed would find none)


def test_every_test_the_architecture_names_exists() -> None:
    missing = []
    for file, test in named_tests():
        path = _file(file)
        if path is None:
            missing.append(file)
        elif test is not None and not re.search(_definition(test), path.read_text(), re.M):
            missing.append(f"{path.relative_to(ROOT)}::{test}")
    assert missing == [], "docs/architecture.md names tests that are not there"
