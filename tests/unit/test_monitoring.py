"""Prometheus and Grafana as docker-compose.yml runs them (read without a Docker engine), the dashboard's
panels, and the series a hub and a worker export before anything has happened."""

from __future__ import annotations

from types import SimpleNamespace
from typing import cast

import yaml

from server.core import Core
from server.settings import Settings
from tests.repofiles import DASHBOARD, ROOT, dashboard_panels, read_yaml


def test_compose_runs_prometheus_on_every_hub_and_worker_and_grafana_on_its_dashboard() -> None:
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    prom, grafana = services["prometheus"], services["grafana"]
    mounts = {m.split(":")[1]: ROOT / m.split(":")[0] for m in prom["volumes"] if m.startswith("./")}
    config = read_yaml(mounts["/etc/prometheus/prometheus.yml"])
    assert any("--config.file=/etc/prometheus/prometheus.yml" == a for a in prom["command"])
    jobs = {j["job_name"]: j["dns_sd_configs"][0] for j in config["scrape_configs"]}
    hub_port = int(services["hub"]["environment"]["REDPACKET_METRICS_PORT"])
    worker_port = int(services["worker"]["environment"].get("REDPACKET_WORKER_METRICS_PORT", "9108"))
    assert jobs["hub"]["names"] == ["hub"] and jobs["hub"]["port"] == hub_port
    assert jobs["worker"]["names"] == ["worker"] and jobs["worker"]["port"] == worker_port
    assert {"hub", "worker"} <= set(prom["depends_on"])

    g_mounts = {m.split(":")[1]: ROOT / m.split(":")[0] for m in grafana["volumes"] if m.startswith("./")}
    provisioning = g_mounts["/etc/grafana/provisioning"]
    source = read_yaml(provisioning / "datasources" / "prometheus.yml")["datasources"][0]
    assert source["url"] == f"http://prometheus:{prom['ports'][0].split(':')[1]}"
    provider = read_yaml(provisioning / "dashboards" / "redpacket.yml")["providers"][0]
    dashboards = g_mounts[provider["options"]["path"]]
    assert (dashboards / "redpacket.json").read_text() == DASHBOARD.read_text()
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{provider['options']['path']}/redpacket.json"
    for panel in dashboard_panels():
        assert panel["datasource"]["uid"] == source["uid"], panel["title"]
        assert panel["targets"] and all(t["datasource"]["uid"] == source["uid"] for t in panel["targets"])


def test_the_dashboard_shows_what_the_issue_asks_for() -> None:
    text = " ".join(p["title"].lower() for p in dashboard_panels())
    for wanted in (
        "grabs/s by outcome",
        "grab latency",
        "connections",
        "frames in / out",
        "send-queue drops",
        "pub/sub reconnects",
        "credit lag p99",
        "backlog",
        "refunds",
        "reconciliation differences",
        "blocks set",
    ):
        assert wanted in text, wanted


def test_reconciliation_gauges_are_absent_until_a_worker_has_reconciled() -> None:
    """Before: 0 differences (and a time of 0: "56 years ago") before any reconciliation ran."""
    from prometheus_client import generate_latest

    from worker.metrics import WorkerMetrics

    metrics = WorkerMetrics(own_process=False)
    assert b"redpacket_reconcile" not in generate_latest(metrics.registry)
    metrics.reconciled.record(0, 1_796_000_000.0)
    page = generate_latest(metrics.registry).decode()
    assert "redpacket_reconcile_differences 0.0" in page
    assert "redpacket_reconciled_at_seconds 1.796e+09" in page


def test_counters_with_known_outcomes_are_exported_at_zero_from_the_start() -> None:
    """Before: after a restart the dashboard's credit and refund panels said "No data" until the first
    one; a series at 0 is what a rate() and an alert need."""
    from server.hub.metrics import HubMetrics
    from server.money.settlement import REFUND_OUTCOMES
    from worker.metrics import CREDIT_OUTCOMES, WorkerMetrics

    worker = WorkerMetrics(own_process=False).registry
    for outcome in CREDIT_OUTCOMES:
        assert worker.get_sample_value("redpacket_credits_total", {"outcome": outcome}) == 0.0
    for outcome in REFUND_OUTCOMES:
        assert worker.get_sample_value("redpacket_refunds_total", {"outcome": outcome}) == 0.0
    hub = HubMetrics().registry
    for outcome in ("won", "already", "empty", "expired"):
        assert hub.get_sample_value("redpacket_grab_outcomes_total", {"outcome": outcome}) == 0.0
    # A configured webhook URL's deliveries, by every result (before: no series until the first one).
    from worker.metrics import WEBHOOK_RESULTS
    from worker.webhooks import Dispatcher

    metrics = WorkerMetrics(own_process=False)
    s = Settings(webhook_urls="https://hooks.example/in?token=s3cret", webhook_secret="w" * 32)
    Dispatcher(cast(Core, SimpleNamespace(settings=s)), metrics)
    for result in WEBHOOK_RESULTS:
        labels = {"endpoint": "hooks.example/in", "result": result}  # (never the query: its token)
        assert metrics.registry.get_sample_value("redpacket_webhook_deliveries_total", labels) == 0.0
