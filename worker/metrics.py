"""Prometheus metrics of one worker process, served by ``redpacket worker`` on its metrics port."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from server.live.dbmetrics import DatabaseCollector
from server.money.settlement import REFUND_OUTCOMES
from worker.outages import Outages

# How the drain counts a credit it committed (``redpacket_credits``): paid now, paid before, refused.
CREDIT_OUTCOMES = ("credited", "already", "refused")


class RedisCpu(Collector):
    """``redpacket_redis_cpu_seconds_total{server}``: the CPU seconds each Redis master has used (INFO cpu,
    read every 5 s) — a counter, as Redis keeps it (a restarted server starts again from 0, which
    ``rate()`` reads as a reset), so dashboards can take its rate."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def set(self, server: str, seconds: float) -> None:
        self.seconds[server] = seconds

    def remove(self, server: str) -> None:
        self.seconds.pop(server, None)

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "redpacket_redis_cpu_seconds", "CPU seconds each Redis master has used", labels=["server"]
        )
        for server, seconds in self.seconds.items():
            family.add_metric([server], seconds)
        yield family


class Reconciled(Collector):
    """``redpacket_reconcile_differences`` and ``redpacket_reconciled_at_seconds``: absent until this worker
    has reconciled once (a 0 before any run would read as "no difference", and a time of 0 as 56 years)."""

    def __init__(self) -> None:
        self.last: tuple[int, float] | None = None

    def record(self, differences: int, at: float) -> None:
        self.last = (differences, at)

    def collect(self) -> Iterator[Metric]:
        if self.last is None:
            return
        differences, at = self.last
        yield GaugeMetricFamily(
            "redpacket_reconcile_differences", "differences found by the last reconciliation", differences
        )
        yield GaugeMetricFamily(
            "redpacket_reconciled_at_seconds", "unix time the last reconciliation finished", at
        )


# How a webhook delivery ends (``redpacket_webhook_deliveries``).
WEBHOOK_RESULTS = ("delivered", "retry", "failed", "lease_lost")


class WebhookMetrics:
    """The webhook dispatcher's (``worker.webhooks``), per URL."""

    def known(self, endpoint: str) -> None:
        """A configured URL's deliveries counted at 0 from the start (a dashboard's panel has a series);
        its gauges wait for their first reading (a 0 there would say "nothing pending" unread)."""
        for result in WEBHOOK_RESULTS:
            self.deliveries.labels(endpoint, result)

    def __init__(self, r: CollectorRegistry) -> None:
        self.deliveries = Counter(
            "redpacket_webhook_deliveries",
            "webhook deliveries by URL (host and path) and result: delivered, retry (failed, due again),"
            " failed (given up), lease_lost (answered after another worker took it over)",
            ["endpoint", "result"],
            registry=r,
        )
        self.latency = Histogram(
            "redpacket_webhook_latency_seconds",
            "from an event's commit to its delivery's acknowledgement",
            ["endpoint"],
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 3600),
            registry=r,
        )
        self.pending = Gauge(
            "redpacket_webhook_pending", "deliveries not yet acknowledged, per URL", ["endpoint"], registry=r
        )
        self.failed = Gauge(
            "redpacket_webhook_failed",
            "deliveries given up, per URL (`redpacket webhooks replay` sends them again)",
            ["endpoint"],
            registry=r,
        )
        self.oldest = Gauge(
            "redpacket_webhook_oldest_pending_seconds",
            "age of the oldest delivery not yet acknowledged, per URL (0: none)",
            ["endpoint"],
            registry=r,
        )


class WorkerMetrics:
    def __init__(self, own_process: bool = True) -> None:
        """``own_process``: this registry also reports the process (not under ``redpacket up``, where
        the hub's registry does, on the same page)."""
        r = self.registry = CollectorRegistry()
        # What the worker's loops met of Redis and the database being away (its log lines, not a gauge).
        self.outages = Outages()
        # The database's retries and failovers, of its own process (under `redpacket up`: the hub's page).
        self.database = DatabaseCollector()
        if own_process:
            ProcessCollector(registry=r)
            r.register(self.database)
        self.credit_lag = Histogram(
            "redpacket_credit_lag_seconds",
            "from the grab (Redis time) to its credit's commit",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
            registry=r,
        )
        self.batch_size = Histogram(
            "redpacket_credit_batch_size",
            "credits per transaction",
            buckets=(1, 2, 5, 10, 25, 50, 100, 250, 500),
            registry=r,
        )
        self.credits = Counter(
            "redpacket_credits",
            "credits committed by this worker, by outcome (credited, already, refused)",
            ["outcome"],
            registry=r,
        )
        for outcome in CREDIT_OUTCOMES:
            self.credits.labels(outcome)  # at 0 from the start: a dashboard's panel has a series
        self.drain_failures = Counter(
            "redpacket_credit_drain_failures", "credit batches that failed and are retried", registry=r
        )
        self.takeovers = Counter(
            "redpacket_credit_takeovers", "credits taken over from a worker that left them unpaid", registry=r
        )
        self.queue_depth = Gauge(
            "redpacket_queue_depth",
            "credits in the outboxes, waiting or being paid (the backlog; read every 5 s)",
            registry=r,
        )
        self.redis_cpu = RedisCpu()
        r.register(self.redis_cpu)
        self.redis_memory = Gauge(
            "redpacket_redis_memory_bytes",
            "memory each Redis master uses (INFO memory)",
            ["server"],
            registry=r,
        )
        self.redis_replicas = Gauge(
            "redpacket_redis_replicas",
            "replicas that could take each Redis master's place (a cluster's not agreed failed, a single"
            " server's connected; read every 5 s)",
            ["server"],
            registry=r,
        )
        self.durability_degraded = Gauge(
            "redpacket_durability_degraded",
            "1 while a master keeps grabs less durable than REDPACKET_GRAB_DURABILITY says: no replica"
            " (replica: its grabs fail; aof+replica: they are on its disk alone), or appendfsync not"
            " always (aof, aof+replica: a crash may lose grabs answered won)",
            ["server"],
            registry=r,
        )
        self.redis_evicting = Gauge(
            "redpacket_redis_evicting",
            "1 while a master's maxmemory-policy is not noeviction: under memory pressure it would drop a"
            " packet's shares and grabs or a credit not yet paid (hubs refuse grabs to it; read every 5 s)",
            ["server"],
            registry=r,
        )
        self.masters: set[str] = set()  # the masters the five gauges above have a series of
        self.healthy_at = Gauge(
            "redpacket_worker_healthy_at_seconds",
            "unix time of the last heartbeat that reached both Redis and the database",
            registry=r,
        )
        self.refunds = Counter("redpacket_refunds", "refund attempts by outcome", ["outcome"], registry=r)
        for outcome in REFUND_OUTCOMES:
            self.refunds.labels(outcome)
        self.refund_failures = Counter("redpacket_refund_failures", "refunds that raised", registry=r)
        self.reconciled = Reconciled()
        r.register(self.reconciled)
        self.swept = Counter(
            "redpacket_sweeper_credited",
            "grabs a minute old the credit drain had not paid, credited by the sweeper (0 unless Redis lost"
            " an outbox entry or no worker drained for a minute)",
            registry=r,
        )
        self.webhooks = WebhookMetrics(r)
        self.blocks_set = Counter("redpacket_blocks_set", "users blocked by the bot detector", registry=r)
