"""How every ``redpacket bench`` ends: its figures, one a line, then one JSON line (the last line of stdout,
for scripts), and with ``--plot DIR`` its charts (named on stderr)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench import plots

Charts = Callable[[Path], Sequence[Path | None]]


def default_charts(name: str, figures: dict[str, Any]) -> Charts:
    """Bars of the rates and of the CPU per operation: the measured beside its baseline."""

    def draw(plot: Path) -> list[Path | None]:
        rates = {k: v for k, v in figures.items() if k.endswith("_per_s")}
        cpu = {k: v for k, v in figures.items() if "cpu_us_per" in k}
        return [
            plots.bars(rates, plot / f"{name}-rates.png", f"{name}: per second", "per second"),
            plots.bars(cpu, plot / f"{name}-cpu.png", f"{name}: CPU per operation", "µs"),
        ]

    return draw


def report(
    name: str,
    figures: dict[str, Any],
    plot: Path | None = None,
    charts: Charts | None = None,
    heading: str = "",
    missing: str = "n/a",
) -> dict[str, Any]:
    """Print ``heading`` (or "<name> benchmark"), each figure (``None`` as ``missing``), the JSON line;
    with ``plot``, draw ``charts`` there (by default: bars of rates and of CPU per operation)."""
    print(heading or f"{name} benchmark")
    width = max((len(k) for k in figures), default=0) + 2
    for k, v in figures.items():
        print(f"  {k:<{width}} {missing if v is None else v}")
    print(json.dumps({"bench": name, **figures}))
    if plot is not None:
        plots.said((charts or default_charts(name, figures))(plot))
    return figures
