"""``redpacket bench split``: the CPU of drawing one packet's shares, as a send does, with the committed
seed's generator (HMAC-SHA-256 in counter mode, ``redpacket_client.fairness``) beside the generator it
replaced (``random.SystemRandom``, the OS's random source, one call a draw) in the same process, on the
same split code. Pure CPU: no services."""

from __future__ import annotations

import random
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.report import report
from redpacket_client.fairness import Stream, commitment, split

# (total cents, shares): a pair, a family group's packet, the largest count a send allows by default.
SIZES = ((888, 2), (10_000, 10), (20_000, 100))


def _cpu_us(draw: Callable[[int], object], n: int) -> float:
    start = time.process_time()
    for i in range(n):
        draw(i)
    return round((time.process_time() - start) / n * 1e6, 2)


def bench_split(n: int = 20_000, plot: Path | None = None) -> dict[str, Any]:
    system = random.SystemRandom()
    seeds = [secrets.token_bytes(32) for _ in range(256)]
    figures: dict[str, Any] = {"splits": n}
    for total, count in SIZES:
        runs = max(200, n * 10 // count)  # as many shares drawn for every size

        def before(i: int, total: int = total, count: int = count) -> object:
            return split("lucky", total, count, system.randrange)

        def after(i: int, total: int = total, count: int = count) -> object:
            seed = seeds[i & 255]
            return split("lucky", total, count, Stream(seed, i + 1, total, count).below)

        old, new = _cpu_us(before, runs), _cpu_us(after, runs)
        figures[f"systemrandom_{count}_shares_cpu_us_per_split"] = old
        figures[f"hmac_seed_{count}_shares_cpu_us_per_split"] = new
        figures[f"ratio_{count}_shares"] = round(new / old, 2)
    # The rest of a send's fairness: the seed drawn and its commitment (once a send).
    figures["seed_and_commitment_cpu_us_per_send"] = _cpu_us(lambda i: commitment(secrets.token_bytes(32)), n)
    return report("split", figures, plot, heading="split benchmark (CPU µs per packet's shares)")
