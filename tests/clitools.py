"""The ``redpacket`` command run as an operator runs it, and what its mistakes must look like: one line
on stderr and an exit code."""

from __future__ import annotations

import subprocess
import sys

from server.settings import child_env


def redpacket(*args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
    """Run the command as an operator would; a hang fails the test (``timeout``)."""
    return subprocess.run(
        [sys.executable, "-m", "server", *args],
        env=child_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_one_line_error(done: subprocess.CompletedProcess[str], code: int, *words: str) -> str:
    """The command ended with exit ``code`` and one line on stderr, ``redpacket: ...``, holding every one
    of ``words`` and no traceback; that line."""
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == code, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr + done.stdout
    assert len(lines) == 1 and lines[0].startswith("redpacket: "), done.stderr
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]
