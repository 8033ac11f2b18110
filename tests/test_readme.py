"""The README as a newcomer follows it: the shell lines and the Python script of "Try it", run as written
against a real ``redpacket up``, and exactly two commands for a newcomer."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hubtools import redpacket_up

README = Path(__file__).resolve().parent.parent / "README.md"


def block(marker: str) -> str:
    """The fenced code between ``<!-- marker -->`` and ``<!-- /marker -->``."""
    m = re.search(rf"<!-- {marker} -->\n```\w*\n(.*?)```\n<!-- /{marker} -->", README.read_text(), re.DOTALL)
    assert m, f"no {marker} block in the README"
    return m[1]


def test_two_commands_for_a_newcomer() -> None:
    text = README.read_text()
    section = text.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```\w*\n(.*?)```", section, re.DOTALL)
    assert len(commands) == 2, commands
    assert "redpacket up" in commands[0] and "pytest" in commands[1]


@pytest.mark.skipif(shutil.which("curl") is None, reason="the README's HTTP lines use curl")
def test_try_it_runs_as_written(tmp_path: Path) -> None:
    with redpacket_up(tmp_path / "data") as (url, _):
        address = url.removeprefix("http://")
        shell = block("try-shell").replace("127.0.0.1:8000", address)
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", shell],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert '"added":1' in done.stdout.replace(" ", ""), done.stdout
        script = tmp_path / "try.py"
        script.write_text(block("try-python").replace("127.0.0.1:8000", address))
        ran = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
        assert ran.returncode == 0, ran.stdout + ran.stderr
        m = re.fullmatch(r"li grabbed (\d+) of 888 cents; 1 share left\n", ran.stdout)
        assert m and 1 <= int(m[1]) <= 887, ran.stdout
