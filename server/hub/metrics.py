"""Prometheus metrics of one hub process, in a registry of its own (served at ``/metrics``)."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from server.live.dbmetrics import DatabaseCollector

log = logging.getLogger(__name__)


HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})


class HubMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        # process_cpu_seconds_total, process_resident_memory_bytes, process_open_fds, ...: this process's.
        ProcessCollector(registry=r)
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
            "grab results: won, already, empty, expired, or the error code (rate_limited, blocked, ...)",
            ["outcome"],
            registry=r,
        )
        for outcome in ("won", "already", "empty", "expired"):
            self.grab_outcomes.labels(outcome)  # at 0 from the start: a dashboard's panel has a series
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
        self.limited = Counter(
            "redpacket_hub_limited",
            "requests and sockets refused by a per-user or per-address limit or by Origin, sockets closed"
            " for a frame flood (frames) and throttled past their bytes a second (bytes), by limit",
            ["limit"],
            registry=r,
        )
        for name in ("address", "user", "service_key", "sockets", "origin", "frames", "bytes"):
            self.limited.labels(name)  # each exported from the start, at 0
        self._backend(r)
        self.gc_pauses = Histogram(
            "redpacket_hub_gc_pause_seconds",
            "how long each garbage collection held the hub's event loop",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
            registry=r,
        )
        self.redis_evicting = Gauge(
            "redpacket_hub_redis_evicting",
            "Redis masters whose maxmemory-policy may drop keys, as last read (grabs to them are refused)",
            registry=r,
        )
        self.gc_pause_max = Gauge(
            "redpacket_hub_gc_pause_max_seconds", "the longest garbage collection so far", registry=r
        )
        self.loop_lag = Histogram(
            "redpacket_hub_loop_lag_seconds",
            "how late the hub's event loop woke a timer (sampled every 0.5 s): its busyness",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=r,
        )
        self.redis_in_use = Gauge(
            "redpacket_redis_connections_in_use",
            "Redis connections lent out by this process's pools",
            registry=r,
        )
        self.db_in_use = Gauge(
            "redpacket_db_connections_in_use", "database connections this process holds right now", registry=r
        )
        self.database = DatabaseCollector()  # retries and failovers (``read_pools``' database's)
        r.register(self.database)
        self.pipelines = PipelineCollector()
        r.register(self.pipelines)
        self.hot_packets = Gauge(
            "redpacket_hot_packets",
            "packets with grabs at Redis or waiting on this hub right now",
            registry=r,
        )
        self.grabs_waiting = Gauge(
            "redpacket_grabs_waiting",
            "grabs of a storm waiting their turn on this hub (storm admission)",
            registry=r,
        )
        self.hot_packet_shares_left = Gauge(
            "redpacket_hot_packet_shares_left",
            "shares left of the packet with the most grabs on the go on this hub (0 when none)",
            registry=r,
        )
        self._gc_started = 0.0
        self._gc_max = 0.0

    def _backend(self, r: CollectorRegistry) -> None:
        """What the chat backend's side of the hub counts: its hook, its service keys."""
        self.hook_seconds = Histogram(
            "redpacket_hook_seconds",
            "how long the chat backend's hook (REDPACKET_HOOK_URL) took to answer, by what was asked",
            ["type"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )
        self.hook_answers = Counter(
            "redpacket_hook_answers",
            "the hook's answers by what was asked (send, withdraw, hold) and answer: allowed, changed (a"
            " send's greeting), denied, no_answer (late, down or nonsense)",
            ["type", "answer"],
            registry=r,
        )
        self.service_key_uses = Counter(
            "redpacket_service_key_uses",
            "Service API calls taken, by the key they came with: current, or previous while"
            " REDPACKET_SERVICE_KEY_PREVIOUS is set (a roll is done when previous stops counting)",
            ["key"],
            registry=r,
        )
        for key in ("current", "previous"):
            self.service_key_uses.labels(key)
        self.service_key_failures = Counter(
            "redpacket_service_key_failures",
            "calls to the chat backend's API with a wrong or missing key (alert on a rise)",
            registry=r,
        )
        self.http_requests = Counter(
            "redpacket_http_requests",
            "HTTP API requests answered (/api/...), by route (as declared: /api/service/accounts/{user_id};"
            " unmatched for no route), method and status",
            ["route", "method", "status"],
            registry=r,
        )
        self.http_seconds = Histogram(
            "redpacket_http_request_seconds",
            "how long HTTP API requests took to answer, by route",
            ["route"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10),
            registry=r,
        )

    def http_answered(self, route: str, method: str, status: int, seconds: float) -> None:
        method = method if method in HTTP_METHODS else "other"  # (a label's values stay few)
        self.http_requests.labels(route, method, str(status)).inc()
        self.http_seconds.labels(route).observe(seconds)

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

    def read_pools(self, redis: Callable[[], float], db: Callable[[], float]) -> None:
        """Pool use, read when scraped."""
        self.redis_in_use.set_function(redis)
        self.db_in_use.set_function(db)

    def read_batcher(self, counts: Callable[[], tuple[int, int]]) -> None:
        """The batches of Redis calls this process's batcher made and the calls in them
        (``Batcher.batches``, ``Batcher.calls``), read when scraped."""
        self.pipelines.counts = counts

    def read_evicting(self, evicting: Callable[[], float]) -> None:
        """Masters that may drop keys, as last read (``Identities.evicting``), read when scraped."""
        self.redis_evicting.set_function(evicting)

    def read_hot(self, hottest: Callable[[], tuple[int, int, int]]) -> None:
        """The storm admission's state (``PacketCache.hottest``), read when scraped."""
        self.hot_packets.set_function(lambda: hottest()[0])
        self.grabs_waiting.set_function(lambda: hottest()[1])
        self.hot_packet_shares_left.set_function(lambda: hottest()[2])

    def frames_in_so_far(self) -> float:
        """Frames received so far (the gc policy's measure of a burst), read through the counter's public
        ``collect()``."""
        for metric in self.frames_in.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    return float(sample.value)
        return 0.0

    async def watch_loop(self, every: float = 0.5) -> None:
        """Observe how late each timer of ``every`` seconds fires, until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + every
            await asyncio.sleep(every)
            self.loop_lag.observe(max(0.0, loop.time() - due))


class PipelineCollector(Collector):
    """``redpacket_redis_pipelines_total`` and ``redpacket_redis_pipelined_calls_total``: their ratio is how
    many calls a pipeline carried (the batcher's group commit at work)."""

    def __init__(self) -> None:
        self.counts: Callable[[], tuple[int, int]] = lambda: (0, 0)

    def collect(self) -> Iterator[CounterMetricFamily]:
        pipelines, calls = self.counts()
        yield CounterMetricFamily(
            "redpacket_redis_pipelines",
            "batches of Redis calls this process's batcher made (a loop tick's calls to one master), each"
            " sent as one pipeline unless refused before it went (a server that changed, or may evict)",
            value=pipelines,
        )
        yield CounterMetricFamily(
            "redpacket_redis_pipelined_calls", "the Redis calls those batches carried", value=calls
        )
