"""What a bench reads of a hub it started: its HTTP root, and figures of its ``/metrics``."""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Callable


def http_url_of(ws_url: str) -> str:
    """A hub's HTTP root, from the websocket URL it said it listens on."""
    return ws_url.replace("ws://", "http://").removesuffix("/ws")


def hub_metrics(http_url: str) -> Callable[[str], float | None]:
    """A hub's /metrics as read now: the value of the first line a pattern matches, None if none does."""
    with urllib.request.urlopen(f"{http_url}/metrics", timeout=10) as r:
        text = r.read().decode()

    def value(pattern: str) -> float | None:
        m = re.search(pattern, text, re.MULTILINE)
        return float(m[1]) if m else None

    return value


def pipelined(http_url: str) -> tuple[float, float]:
    """A hub's Redis pipelines so far and the calls in them."""
    value = hub_metrics(http_url)
    names = ("redpacket_redis_pipelines_total", "redpacket_redis_pipelined_calls_total")
    pipelines, calls = (value(rf"^{name} (\S+)$") for name in names)
    if pipelines is None or calls is None:
        raise RuntimeError(f"the hub's /metrics lacks {' or '.join(names)}")
    return pipelines, calls
