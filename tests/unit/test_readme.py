"""The README's promise to a newcomer, read from it: exactly two commands, one that installs and runs the
system, one that installs and runs the tests. (What they and "Try it" do is tests/test_readme.py's.)"""

from __future__ import annotations

import re

from tests.repofiles import ROOT

README = ROOT / "README.md"


def test_two_commands_for_a_newcomer() -> None:
    text = README.read_text()
    section = text.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```\w*\n(.*?)```", section, re.DOTALL)
    assert len(commands) == 2, commands
    assert "redpacket up" in commands[0] and "pytest" in commands[1]
