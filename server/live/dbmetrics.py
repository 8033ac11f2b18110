"""The database's metrics, for a hub's or a worker's registry: what ``Database.health`` has counted."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from server.store.db import Database


class DatabaseCollector(Collector):
    """``redpacket_db_retries_total{reason}`` (transactions run again: ``deadlock`` — on Galera also a
    certification conflict —, ``lock_wait``, ``node_not_ready``, ``connection``, ``timeout``, ``busy``,
    ``failover``, ``commit_unknown``), ``redpacket_db_failovers_total`` (moves to another node) and
    ``redpacket_db_writer{writer}`` (1 for the node this process writes to). Nothing until ``watch``."""

    def __init__(self) -> None:
        self.db: Database | None = None

    def watch(self, db: Database) -> None:
        self.db = db

    def collect(self) -> Iterator[Metric]:
        if self.db is None:
            return
        health = self.db.health
        retries = CounterMetricFamily(
            "redpacket_db_retries", "database transactions run again, by reason", labels=["reason"]
        )
        for reason, n in sorted(health.retries.items()):
            retries.add_metric([reason], n)
        yield retries
        yield CounterMetricFamily(
            "redpacket_db_failovers", "moves of this process to another database node", health.failovers
        )
        if self.db.writer:
            writer = GaugeMetricFamily(
                "redpacket_db_writer", "the database node this process writes to", labels=["writer"]
            )
            writer.add_metric([self.db.writer], 1)
            yield writer
