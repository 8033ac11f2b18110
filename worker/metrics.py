"""Prometheus metrics of one worker process, served by ``redpacket worker`` on its metrics port."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class WorkerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
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
        self.queue_depth = Gauge(
            "redpacket_queue_depth",
            "credits in the outboxes, waiting or being paid (read by the sweeper)",
            registry=r,
        )
        self.healthy_at = Gauge(
            "redpacket_worker_healthy_at_seconds",
            "unix time of the last heartbeat that reached both Redis and the database",
            registry=r,
        )
        self.refunds = Counter("redpacket_refunds", "refund attempts by outcome", ["outcome"], registry=r)
        self.refund_failures = Counter("redpacket_refund_failures", "refunds that raised", registry=r)
        self.reconcile_differences = Gauge(
            "redpacket_reconcile_differences", "differences found by the last reconciliation", registry=r
        )
        self.blocks_set = Counter("redpacket_blocks_set", "users blocked by the bot detector", registry=r)
