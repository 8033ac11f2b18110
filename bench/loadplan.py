"""Pure arithmetic of ``redpacket load``: the step-up plan, percentiles from Locust's and Prometheus's
counts, one stage's figures, and where the knee is. No I/O; the Locust side is ``bench.locustfile``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

# The locustfile's own flags, which `redpacket load` passes on to Locust: (flag, type, default, help).
# Read by both sides (the locustfile's parser, and `redpacket load --help`).
LOCUST_FLAGS: tuple[tuple[str, type, Any, str], ...] = (
    ("--send-every", float, 10.0, "seconds between two packets of one admin"),
    ("--reaction-ms", float, 800.0, "median reaction time of a member before grabbing, in ms"),
    ("--chat-every", float, 30.0, "mean seconds between two chats of a member (0: none)"),
    ("--hub-metrics", str, "", "every hub process's /metrics, comma-separated (default: the --host's)"),
    ("--worker-metrics", str, "", "every worker's /metrics, comma-separated (http://host:9108/metrics)"),
)

# A stage is past the knee when its grab P99 is this many times the first stage's (and above the floor),
# or its error rate above ERROR_RATE_LIMIT (the seeds: over 0.5% investigate, over 1% unacceptable), or
# grabs/s grew less than THROUGHPUT_GAIN times while the users grew at least that much.
P99_FACTOR = 2.0
P99_FLOOR_MS = 100.0
ERROR_RATE_LIMIT = 0.01
THROUGHPUT_GAIN = 1.1


def server_frames(buffer: bytes | bytearray) -> tuple[list[tuple[int, bytes]], int]:
    """Whole websocket frames a server sent (unmasked, RFC 6455) at the start of ``buffer``: their
    (opcode, payload), and how many bytes they took. A frame not yet whole is left for the next read.
    Fragmented messages are not reassembled (the hub never fragments)."""
    frames: list[tuple[int, bytes]] = []
    at, end = 0, len(buffer)
    while end - at >= 2:
        opcode, length = buffer[at] & 0x0F, buffer[at + 1] & 0x7F
        head = 2
        if length == 126:
            if end - at < 4:
                break
            length, head = int.from_bytes(buffer[at + 2 : at + 4], "big"), 4
        elif length == 127:
            if end - at < 10:
                break
            length, head = int.from_bytes(buffer[at + 2 : at + 10], "big"), 10
        if end - at < head + length:
            break
        frames.append((opcode, bytes(buffer[at + head : at + head + length])))
        at += head + length
    return frames, at


@dataclass(frozen=True)
class Stage:
    users: int
    seconds: float
    ends_at: float  # seconds from the start of the run


def parse_stages(text: str) -> list[Stage]:
    """``"1000:60,2000:60"`` (users:seconds, in order) → stages with their end times. Raises ValueError
    with a message fit for an operator."""
    stages: list[Stage] = []
    ends = 0.0
    for part in (p.strip() for p in text.split(",")):
        users_text, sep, seconds_text = part.partition(":")
        try:
            users, seconds = int(users_text), float(seconds_text)
        except ValueError:
            raise ValueError(f"stage {part!r} is not users:seconds (e.g. 1000:60)") from None
        if not sep or users < 1 or not seconds > 0 or not math.isfinite(seconds):
            raise ValueError(f"stage {part!r}: users must be at least 1 and seconds more than 0")
        ends += seconds
        stages.append(Stage(users, seconds, ends))
    if not stages:
        raise ValueError("--stages is empty")
    return stages


def stage_at(stages: list[Stage], elapsed: float) -> int | None:
    """Index of the stage running ``elapsed`` seconds into the run; None once the last has ended."""
    for i, s in enumerate(stages):
        if elapsed < s.ends_at:
            return i
    return None


def percentile(counts: Mapping[int, int], q: float) -> float:
    """The ``q`` quantile (0..1) of a {value: how many} distribution (Locust's rounded milliseconds):
    the smallest value with at least ``q`` of the samples at or below it; 0 when empty."""
    total = sum(counts.values())
    if total <= 0:
        return 0.0
    wanted = q * total
    seen = 0
    for value in sorted(counts):
        seen += counts[value]
        if seen >= wanted:
            return float(value)
    return float(max(counts))


def subtract(later: Mapping[int, int], earlier: Mapping[int, int]) -> dict[int, int]:
    """What a cumulative {value: count} gained between two snapshots."""
    return {k: n - earlier.get(k, 0) for k, n in later.items() if n - earlier.get(k, 0) > 0}


def bucket_quantile(buckets: Iterable[tuple[float, float]], q: float) -> float | None:
    """Prometheus's ``histogram_quantile``: cumulative ``(le, count)`` buckets (``+Inf`` last) →
    the ``q`` quantile, interpolated linearly inside its bucket; None when there are no samples."""
    ordered = sorted(buckets)
    if not ordered or ordered[-1][1] <= 0:
        return None
    rank = q * ordered[-1][1]
    lower, below = 0.0, 0.0
    for le, count in ordered:
        if count >= rank:
            if math.isinf(le):
                return lower  # beyond the last finite bound: the bound is all that is known
            if count == below:
                return le
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return ordered[-1][0]


@dataclass
class StageFigures:
    """One stage of a run: what the clients saw, and what the servers said meanwhile."""

    users: int
    seconds: float
    requests: int = 0
    failures: int = 0
    grabs: int = 0
    won: int = 0
    # Grabs the load asked for: packets the members saw (each one a grab a person would make). What the
    # system served is judged against this, not against the users alone.
    offered: int = 0
    # Packets the admins sent: offered grabs that stop growing while these do point at the system (it
    # delivers fewer packet events), not at the load.
    sends: int = 0
    grab_p50_ms: float = 0.0
    grab_p99_ms: float = 0.0
    connect_p99_ms: float = 0.0
    client_cpu_percent: float | None = None
    server: dict[str, float | None] = field(default_factory=dict)

    @property
    def error_rate(self) -> float:
        return self.failures / self.requests if self.requests else 0.0

    @property
    def grabs_per_second(self) -> float:
        return self.grabs / self.seconds if self.seconds > 0 else 0.0

    @property
    def offered_per_second(self) -> float:
        return self.offered / self.seconds if self.seconds > 0 else 0.0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StageFigures:
        """The figures ``as_dict`` wrote (the report JSON)."""
        return cls(
            users=int(d["users"]),
            seconds=float(d["seconds"]),
            requests=int(d["requests"]),
            failures=int(d["failures"]),
            grabs=int(d["grabs"]),
            won=int(d["won"]),
            offered=int(d.get("offered", 0)),
            sends=int(d.get("sends", 0)),
            grab_p50_ms=float(d["grab_p50_ms"]),
            grab_p99_ms=float(d["grab_p99_ms"]),
            connect_p99_ms=float(d["connect_p99_ms"]),
            client_cpu_percent=d.get("client_cpu_percent"),
            server=dict(d.get("server", {})),
        )

    def as_dict(self) -> dict[str, object]:
        return {
            "users": self.users,
            "seconds": round(self.seconds, 1),
            "requests": self.requests,
            "failures": self.failures,
            "error_rate": round(self.error_rate, 5),
            "grabs": self.grabs,
            "won": self.won,
            "offered": self.offered,
            "sends": self.sends,
            "offered_per_second": round(self.offered_per_second, 1),
            "grabs_per_second": round(self.grabs_per_second, 1),
            "grab_p50_ms": self.grab_p50_ms,
            "grab_p99_ms": self.grab_p99_ms,
            "connect_p99_ms": self.connect_p99_ms,
            "client_cpu_percent": self.client_cpu_percent,
            "server": self.server,
        }


def knee(stages: list[StageFigures]) -> tuple[int | None, str]:
    """The first stage past the knee (its index) and why; (None, reason) when every stage held. Throughput
    that stopped growing is the system's knee only if the load offered more: when the grabs offered (the
    packets the members saw) did not grow either, the load was the limit, and the verdict says so."""
    if not stages:
        return None, "no stage ran"
    base = stages[0].grab_p99_ms
    load_bound = ""
    for i, s in enumerate(stages):
        if s.error_rate > ERROR_RATE_LIMIT:
            return i, f"error rate {s.error_rate:.1%} over {ERROR_RATE_LIMIT:.0%} at {s.users} users"
        if base and s.grab_p99_ms > max(P99_FLOOR_MS, P99_FACTOR * base):
            return (
                i,
                f"grab P99 {s.grab_p99_ms:.0f} ms, over {P99_FACTOR:g}× the first stage's, "
                f"at {s.users} users",
            )
        if i and s.users >= THROUGHPUT_GAIN * stages[i - 1].users:
            prev = stages[i - 1]
            gain = min(THROUGHPUT_GAIN, s.users / prev.users)
            before = prev.grabs_per_second
            if before and s.grabs_per_second < before * gain:
                offered = prev.offered_per_second
                sent_more = prev.sends and s.sends / s.seconds >= prev.sends / prev.seconds * gain
                if offered and s.offered_per_second < offered * gain and not sent_more:
                    load_bound = load_bound or (
                        f"; the load was the limit from {s.users} users: it offered "
                        f"{offered:.0f} → {s.offered_per_second:.0f} grabs/s (more packets: --send-every,"
                        " or more members per group)"
                    )
                    continue
                return i, (
                    f"grabs/s {s.grabs_per_second:.0f} did not grow with the users "
                    f"({prev.users} → {s.users}; was {before:.0f}) while the grabs offered did "
                    f"({offered:.0f} → {s.offered_per_second:.0f}/s)"
                    if offered
                    else f"grabs/s {s.grabs_per_second:.0f} did not grow with the users "
                    f"({prev.users} → {s.users}; was {before:.0f})"
                )
    return None, f"no knee up to {stages[-1].users} users{load_bound}"
