"""Progress of a benchmark's long phases, on stderr (stdout keeps the figures and the JSON line): rich's
bars on a terminal; otherwise a plain line when a phase starts, every 5 seconds while it runs, and when
it ends."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

PLAIN_EVERY_S = 5.0


class Phase:
    """One phase: ``advance(n)`` as work is done, or ``update(done)`` with a count read from outside."""

    def __init__(self, label: str, total: int | None, bar: Any = None, task: Any = None) -> None:
        self.label, self.total, self.done = label, total, 0
        self.started = self._said = time.monotonic()
        self._bar, self._task = bar, task

    def advance(self, n: int = 1) -> None:
        self.update(self.done + n)

    def update(self, done: int) -> None:
        self.done = done
        if self._bar is not None:
            self._bar.update(self._task, completed=done)
            return
        now = time.monotonic()
        if now - self._said >= PLAIN_EVERY_S:
            self._said = now
            of = f"/{self.total:,}" if self.total else ""
            print(f"  … {self.label}: {done:,}{of} ({now - self.started:.0f} s)", file=sys.stderr, flush=True)


@contextmanager
def phase(label: str, total: int | None = None) -> Iterator[Phase]:
    """A bench phase; a bar (or lines) while the block runs."""
    if sys.stderr.isatty():
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
        console = Console(stderr=True)
        with Progress(*columns, console=console, transient=False, redirect_stdout=False) as bar:
            task = bar.add_task(label, total=total)
            yield Phase(label, total, bar, task)
        return
    print(f"  … {label}", file=sys.stderr, flush=True)
    p = Phase(label, total)
    yield p
    print(f"  ✓ {label} ({time.monotonic() - p.started:.1f} s)", file=sys.stderr, flush=True)
