"""The Locust side of ``redpacket load``: the step-up shape, and the report: per stage, what the clients
saw and what the servers' ``/metrics`` said. The members and admins are ``bench.loadusers``'s.

Run it through ``redpacket load`` (which prepares the users and groups and reads the report); Locust
itself loads this file in every process of a run (``locust -f bench/locustfile.py``), master and
workers alike, and finds the users among its names.
"""

from __future__ import annotations

import json
import logging
import os
import time
import urllib.request
from typing import Any, ClassVar

import gevent
import psutil
from locust import LoadTestShape, between, events
from locust.env import Environment
from locust.runners import MasterRunner, WorkerRunner
from prometheus_client.parser import text_string_to_metric_families

from bench.loadplan import (
    LOCUST_FLAGS,
    StageFigures,
    bucket_quantile,
    parse_stages,
    percentile,
    stage_at,
    subtract,
)
from bench.loadusers import OFFERED, Admin, Fixture, Member

log = logging.getLogger("redpacket.load")

# The users Locust runs: found among this file's names.
USERS = (Member, Admin)
STAGES_ENV = "REDPACKET_LOAD_STAGES"  # set by `redpacket load` when the run is a step-up


def _options(parser: Any) -> None:
    group = parser.add_argument_group("redpacket")
    group.add_argument("--redpacket-fixture", default="", help="users and groups of the run (JSON)")
    group.add_argument("--redpacket-report", default="", help="where the master writes the stage report")
    for flag, kind, default, what in LOCUST_FLAGS:
        group.add_argument(flag, type=kind, default=default, help=what)


def _init(environment: Environment, **_: Any) -> None:
    options = environment.parsed_options
    if options is None:
        return
    if options.redpacket_fixture and not isinstance(environment.runner, MasterRunner):
        Fixture.load(options.redpacket_fixture)
        Admin.fixed_count = len(Fixture.groups)
    elif options.redpacket_fixture:
        with open(options.redpacket_fixture) as f:
            Admin.fixed_count = len(json.load(f)["groups"])
    # Admins do not send in step: each waits between half and one and a half of --send-every.
    Admin.wait_time = between(options.send_every / 2, options.send_every * 1.5)
    if environment.web_ui is not None and environment.web_ui.app is not None:
        # The stage table and the servers' figures, live, beside Locust's own pages.
        environment.web_ui.app.add_url_rule("/redpacket", "redpacket", lambda: Recorder.snapshot_json())


# --- the report: per stage, what the clients saw and what the servers said -----------------------------


# What each worker reports about the same shared thing (each Redis master, the outboxes, the last
# reconciliation): taken once across workers (the largest), never summed.
SHARED = frozenset(
    {
        "redpacket_redis_cpu_seconds_total",
        "redpacket_redis_memory_bytes",
        "redpacket_redis_replicas",
        "redpacket_durability_degraded",
        "redpacket_queue_depth",
        "redpacket_reconcile_differences",
        "redpacket_reconciled_at_seconds",
    }
)


def scrape(urls: list[tuple[str, str]]) -> dict[str, Any]:
    """Sum the metrics the report reads over every (role, URL): counters and gauges by name (and label
    set), histograms as cumulative buckets; the process's own (``process_cpu_seconds_total``) by role.
    ``complete`` is false when a URL did not answer (its rates are then not computed)."""
    values: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {}
    complete = True
    for role, url in urls:
        try:
            with urllib.request.urlopen(url, timeout=10) as reply:
                text = reply.read().decode()
        except Exception as e:
            log.warning("cannot read %s: %s", url, e)
            complete = False
            continue
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    le = float(sample.labels["le"])
                    b = buckets.setdefault(sample.name[: -len("_bucket")], {})
                    b[le] = b.get(le, 0.0) + sample.value
                    continue
                labels = dict(sample.labels)
                if sample.name.startswith("process_"):
                    labels["role"] = role
                label = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
                key = f"{sample.name}{{{label}}}" if label else sample.name
                if sample.name in SHARED:  # every worker reads the same: once, not summed
                    values[key] = max(values.get(key, sample.value), sample.value)
                else:
                    values[key] = values.get(key, 0.0) + sample.value
    return {"values": values, "buckets": buckets, "complete": complete}


def _sum(values: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in values.items() if k == prefix or k.startswith(prefix + "{"))


def server_figures(before: dict[str, Any], after: dict[str, Any], seconds: float) -> dict[str, float | None]:
    """What the servers did between two scrapes: rates, P99s of what happened in between, gauges now."""

    def p99(name: str) -> float | None:
        later = after["buckets"].get(name, {})
        earlier = before["buckets"].get(name, {})
        q = bucket_quantile([(le, n - earlier.get(le, 0.0)) for le, n in later.items()], 0.99)
        return None if q is None else round(q * 1000, 1)

    a, b = after["values"], before["values"]

    def rate(prefix: str) -> float:
        return round((_sum(a, prefix) - _sum(b, prefix)) / seconds, 1) if seconds > 0 else 0.0

    if not (before.get("complete") and after.get("complete")):
        seconds = 0.0  # a server did not answer one of the two scrapes: no rates from them

    def cpu(key: str) -> float | None:
        used = a.get(key, 0.0) - b.get(key, 0.0)
        return round(100 * used / seconds, 1) if seconds > 0 and key in a and used >= 0 else None

    redis_cpu = _sum(a, "redpacket_redis_cpu_seconds_total") - _sum(b, "redpacket_redis_cpu_seconds_total")
    return {
        "grabs_per_second": rate("redpacket_grab_outcomes_total"),
        "won_per_second": rate("redpacket_grab_outcomes_total{outcome=won}"),
        "grab_p99_ms": p99("redpacket_grab_seconds"),
        "credit_lag_p99_ms": p99("redpacket_credit_lag_seconds"),
        "loop_lag_p99_ms": p99("redpacket_hub_loop_lag_seconds"),
        "credits_per_second": rate("redpacket_credits_total"),
        "backlog": _sum(a, "redpacket_queue_depth"),
        "connections": _sum(a, "redpacket_hub_connections"),
        "send_queue_drops": _sum(a, "redpacket_send_queue_drops_total"),
        "refunds": _sum(a, "redpacket_refunds_total"),
        # (None until a worker has reconciled: the gauge is absent, not 0)
        "reconcile_differences": a.get("redpacket_reconcile_differences"),
        "redis_cpu_percent": round(100 * redis_cpu / seconds, 1) if seconds > 0 and redis_cpu >= 0 else None,
        "hub_cpu_percent": cpu("process_cpu_seconds_total{role=hub}"),
        "worker_cpu_percent": cpu("process_cpu_seconds_total{role=worker}"),
    }


class Recorder:
    """On the master (or the one local process): snapshots of Locust's stats and the servers' metrics at
    each stage's end, every few seconds a server sample; the report written at quit."""

    environment: Environment | None = None
    stages: ClassVar[list[StageFigures]] = []
    samples: ClassVar[list[dict[str, Any]]] = []
    _mark: ClassVar[dict[str, Any]] = {}
    peak_users = 0
    remote_cpu_seconds = 0.0
    _greenlet: Any = None

    @classmethod
    def urls(cls) -> list[tuple[str, str]]:
        env = cls.environment
        assert env is not None and env.parsed_options is not None
        o = env.parsed_options
        hubs = [u for u in o.hub_metrics.split(",") if u] or [f"{(env.host or '').rstrip('/')}/metrics"]
        return [("hub", u) for u in hubs] + [("worker", u) for u in o.worker_metrics.split(",") if u]

    @classmethod
    def _stats(cls) -> dict[tuple[str, str], tuple[int, int, dict[int, int]]]:
        assert cls.environment is not None
        return {
            (e.method or "", e.name): (e.num_requests, e.num_failures, dict(e.response_times))
            for e in cls.environment.stats.entries.values()
        }

    @classmethod
    def _client_cpu(cls) -> float:
        """CPU seconds of the load's own processes so far: this one and the workers it forked
        (``--processes``); workers elsewhere (``--master``) as they report their CPU, summed over time."""
        me = psutil.Process()
        children = me.children(recursive=True)
        total = cls.remote_cpu_seconds if not children else 0.0
        for p in [me, *children]:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        return total

    @classmethod
    def _count_remote_cpu(cls, seconds: float) -> None:
        runner = cls.environment.runner if cls.environment is not None else None
        if isinstance(runner, MasterRunner):
            cls.remote_cpu_seconds += seconds * sum(w.cpu_usage for w in runner.clients.values()) / 100

    @classmethod
    def start(cls, environment: Environment) -> None:
        cls.environment = environment
        cls.stages, cls.samples = [], []
        cls._mark = cls._take(0)
        cls._greenlet = gevent.spawn(cls._sample_forever)

    @classmethod
    def _take(cls, users: int) -> dict[str, Any]:
        return {
            "at": time.monotonic(),
            "users": users,
            "stats": cls._stats(),
            "server": scrape(cls.urls()),
            "cpu": cls._client_cpu(),
        }

    @classmethod
    def _sample_forever(cls) -> None:
        started = time.monotonic()
        last = cls._mark
        while True:
            gevent.sleep(2.0)
            cls._count_remote_cpu(2.0)
            env = cls.environment
            users = env.runner.user_count if env is not None and env.runner is not None else 0
            cls.peak_users = max(cls.peak_users, users)
            now = cls._take(users)
            figures = server_figures(last["server"], now["server"], now["at"] - last["at"])
            cls.samples.append({"t": round(now["at"] - started, 1), "users": users, **figures})
            last = now

    @classmethod
    def stage_done(cls, users: int) -> None:
        """Close the stage that ran with ``users`` users."""
        if cls.environment is None:
            return
        now = cls._take(users)
        before, seconds = cls._mark, now["at"] - cls._mark["at"]
        s = StageFigures(users=users, seconds=seconds)
        grab_times: dict[int, int] = {}
        connect_times: dict[int, int] = {}
        for key, (n, failed, times) in now["stats"].items():
            n0, f0, t0 = before["stats"].get(key, (0, 0, {}))
            s.requests += n - n0
            s.failures += failed - f0
            gained = subtract(times, t0)
            if key[0] == OFFERED:  # not a request: a packet a member saw
                s.requests -= n - n0
                s.offered += n - n0
                continue
            if key[0] == "send":
                s.sends += n - n0
            if key[0] == "grab":
                s.grabs += n - n0
                if key[1] in ("won", "already"):
                    s.won += n - n0
                for ms, c in gained.items():
                    grab_times[ms] = grab_times.get(ms, 0) + c
            elif key[0] == "connect":
                for ms, c in gained.items():
                    connect_times[ms] = connect_times.get(ms, 0) + c
        s.grab_p50_ms = percentile(grab_times, 0.5)
        s.grab_p99_ms = percentile(grab_times, 0.99)
        s.connect_p99_ms = percentile(connect_times, 0.99)
        if seconds > 0:
            s.client_cpu_percent = round(100 * (now["cpu"] - before["cpu"]) / seconds, 1)
        s.server = server_figures(before["server"], now["server"], seconds)
        cls.stages.append(s)
        cls._mark = now
        log.info(
            "stage %d users: %.0f grabs/s, grab P99 %.0f ms, errors %.2f%%, credit lag P99 %s ms, backlog %s",
            users,
            s.grabs_per_second,
            s.grab_p99_ms,
            100 * s.error_rate,
            s.server.get("credit_lag_p99_ms"),
            s.server.get("backlog"),
        )

    @classmethod
    def snapshot_json(cls) -> str:
        totals = {
            f"{method} {name}": {"requests": n, "failures": failed}
            for (method, name), (n, failed, _) in (cls._stats() if cls.environment else {}).items()
        }
        return json.dumps(
            {"stages": [s.as_dict() for s in cls.stages], "samples": cls.samples[-300:], "totals": totals}
        )

    @classmethod
    def write(cls) -> None:
        env = cls.environment
        if env is None or env.parsed_options is None:
            return
        if cls._greenlet is not None:
            cls._greenlet.kill(block=False)
        # Written at quit, once every user has stopped: ``totals`` count every reply, those of the
        # requests still in flight when the run ended included (Locust's CSV is written once a second and
        # may miss the last of them).
        path = env.parsed_options.redpacket_report
        if path:
            with open(path, "w") as f:
                f.write(cls.snapshot_json())


def _reports(environment: Environment) -> bool:
    return not isinstance(environment.runner, WorkerRunner)


def _test_start(environment: Environment, **_: Any) -> None:
    if _reports(environment) and Recorder.environment is None:
        Recorder.start(environment)


def _test_stop(environment: Environment, **_: Any) -> None:
    # A run without stages (--users N) is one stage, closed when it stops.
    if _reports(environment) and Recorder.environment is not None and not StepUp.active:
        runner = environment.runner
        Recorder.stage_done(max(Recorder.peak_users, runner.target_user_count or 0 if runner else 0))


def _quitting(environment: Environment, **_: Any) -> None:
    if _reports(environment):
        Recorder.write()


class StepUp(LoadTestShape):
    """Users:seconds stages from ``REDPACKET_LOAD_STAGES``; each stage's figures are closed as it ends."""

    active = False
    abstract = STAGES_ENV not in os.environ

    def __init__(self) -> None:
        super().__init__()
        self.stages = parse_stages(os.environ.get(STAGES_ENV, "1:1"))
        self.current: int | None = None
        StepUp.active = True

    def tick(self) -> tuple[int, float] | None:
        i = stage_at(self.stages, self.get_run_time())
        if i != self.current:
            if self.current is not None:
                Recorder.stage_done(self.stages[self.current].users)
            self.current = i
        if i is None:
            return None
        users = self.stages[i].users
        previous = self.stages[i - 1].users if i else 0
        # Reach the stage's users within a fifth of it (at least 10 a second): the step, then the hold.
        rate = max(10.0, abs(users - previous) / max(1.0, self.stages[i].seconds / 5))
        return users, rate


events.init_command_line_parser.add_listener(_options)
events.init.add_listener(_init)
events.test_start.add_listener(_test_start)
events.test_stop.add_listener(_test_stop)
events.quitting.add_listener(_quitting)
