"""Prometheus and Grafana as docker-compose.yml runs them (checked without a Docker engine), and every
metric the dashboard, the load report and the operator's documents name is one a running hub and worker
export."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from server.settings import Settings
from tests.hubtools import eventually, free_port, hub_process, worker_env

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "monitoring" / "grafana" / "dashboards" / "redpacket.json"
METRIC = re.compile(r"\b(?:redpacket|process)_[a-z0-9_]+\b")


def _yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def _panels() -> list[dict[str, Any]]:
    return [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] != "row"]


def _exported(text: str) -> set[str]:
    """Every series name a /metrics page can hold: counters as ``_total``, histograms with their
    ``_bucket`` / ``_sum`` / ``_count`` (declared even before their first sample)."""
    names: set[str] = set()
    for line in text.splitlines():
        m = re.match(r"# TYPE (\S+) (\S+)", line)
        if m:
            names.add(m[1])
            if m[2] == "histogram":
                names |= {f"{m[1]}_bucket", f"{m[1]}_sum", f"{m[1]}_count"}
    return {n for n in names if n.startswith(("redpacket_", "process_")) and not n.endswith("_created")}


@pytest.mark.unit
def test_compose_runs_prometheus_on_every_hub_and_worker_and_grafana_on_its_dashboard() -> None:
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    prom, grafana = services["prometheus"], services["grafana"]
    mounts = {m.split(":")[1]: ROOT / m.split(":")[0] for m in prom["volumes"] if m.startswith("./")}
    config = _yaml(mounts["/etc/prometheus/prometheus.yml"])
    assert any("--config.file=/etc/prometheus/prometheus.yml" == a for a in prom["command"])
    jobs = {j["job_name"]: j["dns_sd_configs"][0] for j in config["scrape_configs"]}
    hub_port = int(services["hub"]["environment"]["REDPACKET_METRICS_PORT"])
    worker_port = int(services["worker"]["environment"].get("REDPACKET_WORKER_METRICS_PORT", "9108"))
    assert jobs["hub"]["names"] == ["hub"] and jobs["hub"]["port"] == hub_port
    assert jobs["worker"]["names"] == ["worker"] and jobs["worker"]["port"] == worker_port
    assert {"hub", "worker"} <= set(prom["depends_on"])

    g_mounts = {m.split(":")[1]: ROOT / m.split(":")[0] for m in grafana["volumes"] if m.startswith("./")}
    provisioning = g_mounts["/etc/grafana/provisioning"]
    source = _yaml(provisioning / "datasources" / "prometheus.yml")["datasources"][0]
    assert source["url"] == f"http://prometheus:{prom['ports'][0].split(':')[1]}"
    provider = _yaml(provisioning / "dashboards" / "redpacket.yml")["providers"][0]
    dashboards = g_mounts[provider["options"]["path"]]
    assert (dashboards / "redpacket.json").read_text() == DASHBOARD.read_text()
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{provider['options']['path']}/redpacket.json"
    for panel in _panels():
        assert panel["datasource"]["uid"] == source["uid"], panel["title"]
        assert panel["targets"] and all(t["datasource"]["uid"] == source["uid"] for t in panel["targets"])


@pytest.mark.unit
def test_the_dashboard_shows_what_the_issue_asks_for() -> None:
    text = " ".join(p["title"].lower() for p in _panels())
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


@asynccontextmanager
async def hub_and_worker(settings: Settings) -> AsyncIterator[tuple[str, str, dict[str, str]]]:
    """``redpacket serve`` and ``redpacket worker`` processes: (hub address, worker metrics URL, the
    /metrics pages read once the worker's first heartbeat has read Redis)."""
    port = free_port()
    worker = subprocess.Popen(  # noqa: ASYNC220 - one worker process for the test
        [sys.executable, "-m", "server", "worker"],
        env=worker_env(settings, port),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    worker_url = f"http://127.0.0.1:{port}/metrics"
    pages: dict[str, str] = {}
    try:
        async with hub_process(settings) as hub, httpx.AsyncClient(timeout=10) as http:
            pages["hub"] = (await http.get(f"{hub.http}/metrics")).text

            async def worker_page() -> bool:
                try:
                    pages["worker"] = (await http.get(worker_url)).text
                except httpx.TransportError:
                    return False
                # The first heartbeat has read Redis (the per-master series have a sample), and the
                # reconciliation a worker makes at its start is done (its gauges are absent before).
                page = pages["worker"]
                return (
                    "redpacket_redis_cpu_seconds_total{" in page
                    and "redpacket_reconciled_at_seconds " in page
                )

            await eventually(worker_page, timeout=60)
            yield hub.http, worker_url, pages
    finally:
        worker.kill()
        await asyncio.to_thread(worker.wait, 30)


async def test_every_metric_named_is_exported_by_a_running_hub_and_worker(hub_settings: Settings) -> None:
    async with hub_and_worker(hub_settings) as (_, _, pages):
        pass
    hub, wk = _exported(pages["hub"]), _exported(pages["worker"])
    assert "redpacket_grab_seconds_bucket" in hub and "redpacket_credit_lag_seconds_bucket" in wk
    exported = hub | wk
    for panel in _panels():
        for target in panel["targets"]:
            named = set(METRIC.findall(target["expr"]))
            assert named and named <= exported, (panel["title"], named - exported)

    # The load report reads these by name (bench/locustfile.py).
    locustfile = ROOT / "server" / "tools" / "locustfile.py"
    load = set(re.findall(r'"(redpacket_[a-z0-9_]+)[{"]', locustfile.read_text()))
    assert load and load <= exported | {m.removesuffix("_bucket") for m in exported}, load - exported

    # docs/operations.md documents every metric (by the name a scrape shows, counters with _total), and no
    # document an operator reads names one that is not exported.
    documented = set(METRIC.findall((ROOT / "docs" / "operations.md").read_text()))
    families = {n for n in exported if not n.endswith(("_bucket", "_sum", "_count"))}
    assert families <= documented, families - documented
    docs = ("README.md", "docs/configuration.md", "docs/operations.md")
    named = set(METRIC.findall("".join((ROOT / d).read_text() for d in docs)))
    assert named <= exported | {"redpacket_test"}, named - exported


def _types(text: str) -> dict[str, str]:
    """Each series name of a /metrics page and its type (a histogram's series as ``histogram``)."""
    types: dict[str, str] = {}
    for m in re.finditer(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE):
        name, kind = m[1], m[2]
        types[name] = kind
        if kind == "counter" and not name.endswith("_total"):
            types[f"{name}_total"] = kind
        if kind == "histogram":
            types |= {f"{name}_bucket": kind, f"{name}_sum": kind, f"{name}_count": kind}
    return types


async def test_every_query_fits_its_metric_and_alarming_panels_have_thresholds(
    hub_settings: Settings,
) -> None:
    """Before: `rate()` of a gauge; each Redis server counted once per worker under one legend; the
    stat panels "must be 0" and "since the last reconciliation" with no thresholds (Grafana's default red
    at 80 showed 1 to 79 differences green)."""
    async with hub_and_worker(hub_settings) as (_, _, pages):
        pass
    types = _types(pages["hub"]) | _types(pages["worker"])
    per_server = set(re.findall(r"^(redpacket_[a-z0-9_]+)\{server=", pages["worker"], re.MULTILINE))
    assert {"redpacket_redis_cpu_seconds_total", "redpacket_redis_memory_bytes"} <= per_server
    for panel in _panels():
        for target in panel["targets"]:
            expr = target["expr"]
            for fn, name in re.findall(r"\b(rate|increase|irate)\((\w+)", expr):
                assert types.get(name) in ("counter", "histogram"), (
                    panel["title"],
                    fn,
                    name,
                    types.get(name),
                )
            if set(METRIC.findall(expr)) & per_server:  # one series per worker per server
                assert "by (server)" in expr, (panel["title"], expr)
        if panel["type"] == "stat":
            steps = panel["fieldConfig"]["defaults"]["thresholds"]["steps"]
            assert steps[0]["value"] is None and steps[0]["color"] == "green", panel["title"]
            assert steps[-1]["color"] == "red", panel["title"]
            if "must be 0" in panel["title"]:
                assert steps[1]["value"] == 1, panel["title"]  # one difference is red
            assert panel["fieldConfig"]["defaults"].get("noValue"), panel["title"]  # absent is said


@pytest.mark.unit
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


def _prometheus() -> str:
    exe = shutil.which("prometheus")
    if exe is None:
        if os.environ.get("REDPACKET_TEST_REQUIRE_PROMETHEUS") == "1":
            pytest.fail(
                "Prometheus is required (REDPACKET_TEST_REQUIRE_PROMETHEUS=1): apt-get install prometheus"
            )
        pytest.skip("no Prometheus: apt-get install prometheus")
    return exe


async def test_prometheus_scrapes_a_hub_and_worker_and_runs_every_dashboard_query(
    hub_settings: Settings, tmp_path: Path
) -> None:
    exe = _prometheus()
    checked = await asyncio.to_thread(
        subprocess.run,
        [
            str(Path(exe).with_name("promtool")),
            "check",
            "config",
            str(ROOT / "monitoring" / "prometheus.yml"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    async with hub_and_worker(hub_settings) as (hub_http, worker_url, _):
        # The compose configuration with its DNS discovery replaced by this machine's two processes.
        config = _yaml(ROOT / "monitoring" / "prometheus.yml")
        config["global"]["scrape_interval"] = "1s"
        for job in config["scrape_configs"]:
            target = hub_http if job["job_name"] == "hub" else worker_url.removesuffix("/metrics")
            del job["dns_sd_configs"]
            job["static_configs"] = [{"targets": [target.removeprefix("http://")]}]
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = free_port()
        prom = subprocess.Popen(  # noqa: ASYNC220 - the Prometheus under test, started once
            [
                exe,
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        api = f"http://127.0.0.1:{port}/api/v1"
        try:
            async with httpx.AsyncClient(timeout=10) as http:

                async def query(expr: str) -> list[Any]:
                    reply = (await http.get(f"{api}/query", params={"query": expr})).json()
                    assert reply["status"] == "success", (expr, reply)
                    return list(reply["data"]["result"])

                async def scraped_twice() -> bool:
                    try:
                        # Until its storage is open Prometheus answers 503 (not JSON) to queries.
                        if (await http.get(f"http://127.0.0.1:{port}/-/ready")).status_code != 200:
                            return False
                        up = await query("count_over_time(up[1m]) >= 3")
                    except httpx.TransportError:
                        return False
                    return {r["metric"]["job"] for r in up} == {"hub", "worker"}

                await eventually(scraped_twice, timeout=60)
                assert {r["metric"]["job"]: r["value"][1] for r in await query("up")} == {
                    "hub": "1",
                    "worker": "1",
                }
                for panel in _panels():
                    for target in panel["targets"]:
                        result = await query(target["expr"].replace("$__rate_interval", "1m"))
                        # What a quiet hub and worker already have: gauges and rates of counters that exist.
                        if panel["title"].startswith(
                            ("Connections", "Credit backlog", "Redis memory", "CPU of")
                        ):
                            assert result, (panel["title"], target["expr"])
        finally:
            prom.terminate()
            await asyncio.to_thread(prom.wait, 30)
