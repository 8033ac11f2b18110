"""Every metric the dashboard, the load report and the operator's documents name is one a running hub and
worker export, and a real Prometheus scrapes them and runs every dashboard query. (Prometheus and Grafana
as docker-compose.yml runs them, read without a Docker engine: ``tests/unit/test_monitoring.py``.)"""

from __future__ import annotations

import asyncio
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
from tests.repofiles import ROOT, dashboard_panels, read_yaml

METRIC = re.compile(r"\b(?:redpacket|process)_[a-z0-9_]+\b")


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
    for panel in dashboard_panels():
        for target in panel["targets"]:
            named = set(METRIC.findall(target["expr"]))
            assert named and named <= exported, (panel["title"], named - exported)

    # The load report reads these by name (bench/locustfile.py).
    locustfile = ROOT / "bench" / "locustfile.py"
    load = set(re.findall(r'"(redpacket_[a-z0-9_]+)[{"]', locustfile.read_text()))
    assert load and load <= exported | {m.removesuffix("_bucket") for m in exported}, load - exported

    # docs/operations.md documents every metric (by the name a scrape shows, counters with _total), and no
    # document an operator reads names one that is not exported.
    documented = set(METRIC.findall((ROOT / "docs" / "operations.md").read_text()))
    families = {n for n in exported if not n.endswith(("_bucket", "_sum", "_count"))}
    assert families <= documented, families - documented
    docs = ("README.md", "docs/configuration.md", "docs/operations.md")
    named = set(METRIC.findall("".join((ROOT / d).read_text() for d in docs)))
    not_metrics = {"redpacket_test", "redpacket_client"}  # (the tests' database, the client's package)
    assert named <= exported | not_metrics, named - exported


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
    for panel in dashboard_panels():
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
        config = read_yaml(ROOT / "monitoring" / "prometheus.yml")
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
                for panel in dashboard_panels():
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
