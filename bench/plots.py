"""PNG plots of the benchmarks and of a load run (matplotlib, no screen needed). Each function takes
the figures a bench or the load report already holds and returns the file it wrote (None if there was
nothing to draw)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bench.loadplan import StageFigures


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    _pyplot().close(fig)
    return path


def latency(
    samples_ms: Sequence[float],
    path: Path,
    title: str,
    baseline_ms: Sequence[float] = (),
    labels: tuple[str, str] = ("measured", "baseline"),
) -> Path | None:
    """The distribution of latencies (log-spaced histogram), with a baseline's beside it if given."""
    if not samples_ms:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    low = max(0.01, min([*samples_ms, *baseline_ms]))
    high = max([*samples_ms, *baseline_ms])
    import numpy as np

    bins = np.logspace(np.log10(low), np.log10(max(high, low * 1.01)), 40)
    if baseline_ms:
        ax.hist(baseline_ms, bins=bins, alpha=0.5, label=labels[1])
    ax.hist(samples_ms, bins=bins, alpha=0.6, label=labels[0])
    ax.set_xscale("log")
    ax.set_xlabel("latency (ms)")
    ax.set_ylabel("replies")
    ax.set_title(title)
    ax.legend()
    return _save(fig, path)


def latency_over_time(points: Sequence[tuple[float, float]], path: Path, title: str) -> Path | None:
    """Each reply as (when it came, s after the first request went; how long it took, ms)."""
    if not points:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.scatter([p[0] for p in points], [p[1] for p in points], s=2, alpha=0.4)
    ax.set_xlabel("replied at (s after the first request went)")
    ax.set_ylabel("latency (ms)")
    ax.set_title(title)
    return _save(fig, path)


def lag_and_backlog(samples: Sequence[dict[str, float]], path: Path, title: str) -> Path | None:
    """Samples of {t, lag_ms (credit lag of the credits paid since the last sample), backlog}."""
    if not samples:
        return None
    plt = _pyplot()
    fig, lag = plt.subplots(figsize=(7, 4))
    t = [s["t"] for s in samples]
    lag.plot(t, [s.get("lag_ms") or 0 for s in samples], color="tab:red", label="credit lag P99 (ms)")
    lag.set_xlabel("time (s)")
    lag.set_ylabel("credit lag P99 of the second's grabs (ms)", color="tab:red")
    backlog = lag.twinx()
    backlog.plot(t, [s.get("backlog") or 0 for s in samples], color="tab:blue", label="backlog")
    backlog.set_ylabel("credits waiting", color="tab:blue")
    lag.set_title(title)
    return _save(fig, path)


def throughput(rows: Sequence[tuple[int, float, float | None]], path: Path, title: str) -> Path | None:
    """(concurrency, per second, baseline per second or None) rows."""
    if not rows:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r[0] for r in rows], [r[1] for r in rows], marker="o", label="measured")
    if any(r[2] is not None for r in rows):
        ax.plot([r[0] for r in rows], [r[2] or 0 for r in rows], marker="s", label="baseline")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("per second")
    ax.set_title(title)
    ax.legend()
    return _save(fig, path)


def stage_plot(stages: Sequence[StageFigures], path: Path) -> Path | None:
    """A load run per stage: grabs/s and grab P99 against users."""
    if not stages:
        return None
    plt = _pyplot()
    fig, rate = plt.subplots(figsize=(7, 4))
    users = [s.users for s in stages]
    rate.plot(users, [s.grabs_per_second for s in stages], marker="o", color="tab:green")
    rate.set_xlabel("users")
    rate.set_ylabel("grabs/s", color="tab:green")
    p99 = rate.twinx()
    p99.plot(users, [s.grab_p99_ms for s in stages], marker="s", color="tab:red")
    p99.plot(users, [100 * s.error_rate for s in stages], marker="x", color="tab:gray")
    p99.set_ylabel("grab P99 (ms, red) · errors (%, gray)")
    rate.set_title("redpacket load: each stage")
    return _save(fig, path)


def server_plot(samples: Sequence[dict[str, Any]], path: Path) -> Path | None:
    """The servers during a load run: users, credit lag P99 and backlog over time."""
    if not samples:
        return None
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    t = [s["t"] for s in samples]
    top.plot(t, [s.get("users") or 0 for s in samples], color="tab:gray")
    top.set_ylabel("users")
    top2 = top.twinx()
    top2.plot(t, [s.get("grabs_per_second") or 0 for s in samples], color="tab:green")
    top2.set_ylabel("hub grabs/s", color="tab:green")
    bottom.plot(t, [s.get("credit_lag_p99_ms") or 0 for s in samples], color="tab:red")
    bottom.set_ylabel("credit lag P99 (ms)", color="tab:red")
    bottom2 = bottom.twinx()
    bottom2.plot(t, [s.get("backlog") or 0 for s in samples], color="tab:blue")
    bottom2.set_ylabel("backlog", color="tab:blue")
    bottom.set_xlabel("time (s)")
    top.set_title("redpacket load: the servers meanwhile")
    return _save(fig, path)


def bars(values: dict[str, float], path: Path, title: str, unit: str) -> Path | None:
    """A bench's comparison: the measured figures beside their baselines, one bar each."""
    shown = {k: v for k, v in values.items() if isinstance(v, int | float)}
    if not shown:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 0.6 * len(shown) + 1.5))
    ax.barh(list(shown), list(shown.values()), color="tab:red")
    for i, v in enumerate(shown.values()):
        ax.text(v, i, f" {v:,.4g}", va="center")
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    ax.set_title(title)
    return _save(fig, path)


def said(paths: Sequence[Path | None]) -> None:
    """Name the plots written (on stderr: stdout ends with the bench's JSON line)."""
    import sys

    for p in paths:
        if p is not None:
            print(f"plot: {p}", file=sys.stderr)
