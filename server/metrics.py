"""Prometheus metrics of one hub process, in a registry of its own (served at ``/metrics``)."""

from __future__ import annotations

import gc
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class HubMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.connections = Gauge("redpacket_hub_connections", "open websocket connections", registry=r)
        self.frames_in = Counter("redpacket_hub_frames_in", "frames received from clients", registry=r)
        self.frames_out = Counter("redpacket_hub_frames_out", "frames sent to clients", registry=r)
        self.grab_seconds = Histogram(
            "redpacket_grab_seconds",
            "grab request latency inside the hub",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=r,
        )
        self.grab_outcomes = Counter(
            "redpacket_grab_outcomes",
            "grab results: won, already, empty, expired, denied",
            ["outcome"],
            registry=r,
        )
        self.grabs_answered_locally = Counter(
            "redpacket_grabs_answered_locally",
            "grabs of packets this hub knew closed (or unknown) answered without Redis",
            registry=r,
        )
        self.pubsub_reconnects = Counter(
            "redpacket_pubsub_reconnects", "times the hub's pub/sub connection was re-established", registry=r
        )
        self.send_queue_drops = Counter(
            "redpacket_send_queue_drops", "connections closed because their send queue overflowed", registry=r
        )
        self.events_published = Counter("redpacket_events_published", "group events published", registry=r)
        self.gc_pauses = Histogram(
            "redpacket_hub_gc_pause_seconds",
            "how long each garbage collection held the hub's event loop",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
            registry=r,
        )
        self.gc_pause_max = Gauge(
            "redpacket_hub_gc_pause_max_seconds", "the longest garbage collection so far", registry=r
        )
        self._gc_started = 0.0
        self._gc_max = 0.0

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
            return
        paused = time.perf_counter() - self._gc_started
        self.gc_pauses.observe(paused)
        if paused > self._gc_max:
            self._gc_max = paused
            self.gc_pause_max.set(paused)

    def watch_gc(self) -> None:
        """Time every garbage collection of this process (until ``unwatch_gc``)."""
        gc.callbacks.append(self._on_gc)

    def unwatch_gc(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
