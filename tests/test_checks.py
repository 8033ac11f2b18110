"""The project's static checks run with the tests, so the one test command checks everything."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "command",
    [
        ["ruff", "format", "--check", "."],
        ["ruff", "check", "."],
        ["mypy"],
    ],
    ids=["ruff-format", "ruff-check", "mypy-strict"],
)
def test_static_check(command: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", *command], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_refuses_a_credit_outcome_it_does_not_know(tmp_path: Path) -> None:
    """The credit outcome is a closed type (``creditrules.Outcome``): a misspelt one is a type error, and
    a ``match`` over outcomes that forgets one fails ``assert_never``."""
    (tmp_path / "misspelt.py").write_text(
        "from typing import assert_never\n"
        "from server.money.creditrules import Outcome, Refusal\n"
        'wrong: Outcome = "credted"\n'
        "def handled(o: Outcome) -> None:\n"
        "    match o:\n"
        '        case "credited" | "already":\n'
        "            pass\n"
        "        case Refusal():\n"
        "            pass\n"
        "        case _:\n"
        "            assert_never(o)  # (later is forgotten)\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", str(tmp_path / "misspelt.py")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    said = done.stdout
    assert done.returncode == 1, said
    assert (
        "misspelt.py:3: error: Incompatible types in assignment (expression has type \"Literal['credted']\""
        in said
    )
    assert (
        'misspelt.py:11: error: Argument 1 to "assert_never" has incompatible type "Literal[\'later\']"'
        in said
    )
