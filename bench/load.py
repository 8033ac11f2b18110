"""``redpacket load``: Locust against a deployment — prepare the users and groups (through the HTTP API of
a hub with dev login and demo top-ups, or from a file), run ``bench/locustfile.py`` under Locust with
every Locust flag passed through, then read the stage report: a table, the knee, a JSON line, the
servers' side added to Locust's HTML report, and plots.
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NoReturn

from bench.loadplan import LOCUST_FLAGS, StageFigures, knee, parse_stages

LOCUSTFILE = Path(__file__).with_name("locustfile.py")
DEFAULT_STAGES = "1000:60,2000:60,5000:60"
STAGES_ENV = "REDPACKET_LOAD_STAGES"
# The locustfile's own flags: forwarded to Locust as they are (they reach its workers too).
FORWARDED = tuple(flag for flag, *_ in LOCUST_FLAGS)


class LoadError(Exception):
    """What an operator got wrong: one line, exit code 2."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="redpacket load",
        # Locust's flags pass through: --worker must not be taken for an abbreviation of --worker-metrics.
        allow_abbrev=False,
        description="Locust against a hub: members grabbing, admins sending, a step-up by default. "
        "Every other flag goes to Locust (--headless, --users, --spawn-rate, --run-time, --html, --csv, "
        "--master, --worker, --processes, ...).",
    )
    p.add_argument("--host", default="http://127.0.0.1:8000", help="the hub's address (http://host:port)")
    p.add_argument(
        "--stages", default=None, help=f"users:seconds,... (default {DEFAULT_STAGES}; none with --users)"
    )
    p.add_argument("--group-size", type=int, default=100, help="members per group (default 100)")
    p.add_argument("--prefix", default="load", help="names of the users made for the run (default load)")
    p.add_argument(
        "--fixture", default=None, help="users and groups from this file, made by --prepare or by you"
    )
    p.add_argument(
        "--prepare", default=None, metavar="FILE", help="only make the users and groups; write FILE"
    )
    p.add_argument("--plot", default=None, metavar="DIR", help="write PNG plots of the run into DIR")
    p.add_argument("--report", default=None, metavar="FILE", help="write the stage report (JSON) here too")
    for flag, _, default, what in LOCUST_FLAGS:
        p.add_argument(flag, default=None, help=f"{what} (default {default})" if default != "" else what)
    return p


# --- preparing users and groups over HTTP --------------------------------------------------------------


# Preparing thousands of users from one address meets the hub's per-address HTTP limit
# (REDPACKET_HTTP_PER_ADDRESS_PER_SECOND): a refused call waits and is made again, this long at most.
RATE_LIMITED_PATIENCE_SECONDS = 600


def _call(host: str, path: str, body: dict[str, Any] | None = None, token: str | None = None) -> Any:
    req = urllib.request.Request(
        f"{host.rstrip('/')}{path}",
        data=None if body is None else json.dumps(body).encode(),
        headers={"authorization": f"Bearer {token}"} if token else {},
    )
    deadline = time.monotonic() + RATE_LIMITED_PATIENCE_SECONDS
    while True:
        try:
            with urllib.request.urlopen(req, timeout=30) as reply:
                return json.load(reply)
        except urllib.error.HTTPError as e:
            if e.code != 429 or time.monotonic() > deadline:
                _failed(host, path, e)
            _say_slowed_once(host)
            time.sleep(1.0)  # (the allowance refills continuously; one call a second is its floor)
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise LoadError(f"cannot reach the hub at {host} ({reason}); is it running? (--host)") from None


_slowed: set[str] = set()


def _say_slowed_once(host: str) -> None:
    if host not in _slowed:
        _slowed.add(host)
        print(
            f"the hub at {host} limits HTTP requests from one address: preparing goes at its pace (a hub"
            " for load tests can raise REDPACKET_HTTP_PER_ADDRESS_PER_SECOND / _BURST)",
            file=sys.stderr,
        )


def _failed(host: str, path: str, e: urllib.error.HTTPError) -> NoReturn:
    try:
        error = json.load(e)["error"]
    except Exception:
        raise LoadError(f"{host}{path} answered HTTP {e.code}") from None
    if error["code"] == "disabled":
        raise LoadError(
            f"the hub at {host} has dev login or demo top-ups off: make the users yourself and "
            "give them with --fixture FILE (format: docs/load.md)"
        ) from None
    raise LoadError(f"{host}{path}: {error['code']}: {error['message']}") from None


def prepare(host: str, members: int, group_size: int, prefix: str) -> dict[str, Any]:
    """Log in ``members`` members and one admin per ``group_size`` of them, top the admins up, make the
    groups and fill them (in order: group k holds members k·size … (k+1)·size − 1)."""
    groups = max(1, math.ceil(members / group_size))
    with ThreadPoolExecutor(16) as pool:

        def login(name: str) -> dict[str, Any]:
            reply = _call(host, "/api/login", {"name": name})
            return {"user_id": reply["user_id"], "name": name, "token": reply["token"]}

        admins = list(pool.map(login, [f"{prefix}-a{k}" for k in range(groups)]))
        people = list(pool.map(login, [f"{prefix}-m{i}" for i in range(members)]))
        run = time.time_ns()

        def make_group(k: int) -> dict[str, Any]:
            admin = admins[k]
            _call(
                host,
                "/api/topup",
                {"amount": 100_000_000, "request_id": f"{prefix}-{run}-{k}"},
                admin["token"],
            )
            gid = _call(host, "/api/groups", {"name": f"{prefix} {k}"}, admin["token"])["group_id"]
            ids = [m["user_id"] for m in people[k * group_size : (k + 1) * group_size]]
            for start in range(0, len(ids), 500):
                _call(
                    host, f"/api/groups/{gid}/members", {"user_ids": ids[start : start + 500]}, admin["token"]
                )
            return {"group_id": gid, "admin": admin, "members": ids}

        made = list(pool.map(make_group, range(groups)))
    return {
        "host": host,
        "topup": True,
        "users": [{**a, "role": "admin"} for a in admins] + [{**m, "role": "member"} for m in people],
        "groups": made,
    }


def check_fixture(data: Any, path: str) -> None:
    """What the locustfile needs of a fixture, said in one line when it is not there."""

    def wrong(what: str) -> LoadError:
        return LoadError(
            f"{path} is not a load fixture ({what}): users [{{user_id, token}}] and groups "
            "[{group_id, admin: {user_id, token}, members}] (docs/load.md)"
        )

    if not isinstance(data, dict):
        raise wrong("not a JSON object")
    for part in ("users", "groups"):
        if not isinstance(data.get(part), list) or not data[part]:
            raise wrong(f"no {part}")
    for u in data["users"]:
        if not (
            isinstance(u, dict) and isinstance(u.get("user_id"), int) and isinstance(u.get("token"), str)
        ):
            raise wrong(f"user {u!r:.60}")
    if not any(u.get("role") != "admin" for u in data["users"]):
        raise wrong("no members: every user is an admin")
    for g in data["groups"]:
        admin = g.get("admin") if isinstance(g, dict) else None
        if not (
            isinstance(g, dict)
            and isinstance(g.get("group_id"), int)
            and isinstance(admin, dict)
            and isinstance(admin.get("token"), str)
        ):
            raise wrong(f"group {g!r:.60}")


# --- reading the report ----------------------------------------------------------------------------------


COLUMNS: tuple[tuple[str, Callable[[StageFigures], str]], ...] = (
    ("users", lambda s: f"{s.users}"),
    ("offered/s", lambda s: f"{s.offered_per_second:.0f}"),
    ("grabs/s", lambda s: f"{s.grabs_per_second:.0f}"),
    ("won/s", lambda s: f"{s.won / s.seconds:.0f}" if s.seconds else "-"),
    ("grab P50 ms", lambda s: f"{s.grab_p50_ms:.0f}"),
    ("grab P99 ms", lambda s: f"{s.grab_p99_ms:.0f}"),
    ("errors", lambda s: f"{100 * s.error_rate:.2f}%"),
    ("connect P99 ms", lambda s: f"{s.connect_p99_ms:.0f}"),
    ("hub grab P99 ms", lambda s: _fmt(s.server.get("grab_p99_ms"))),
    ("credit lag P99 ms", lambda s: _fmt(s.server.get("credit_lag_p99_ms"))),
    ("backlog", lambda s: _fmt(s.server.get("backlog"))),
    ("hub loop lag P99 ms", lambda s: _fmt(s.server.get("loop_lag_p99_ms"))),
    ("hub CPU", lambda s: _fmt(s.server.get("hub_cpu_percent"), "%")),
    ("worker CPU", lambda s: _fmt(s.server.get("worker_cpu_percent"), "%")),
    ("Redis CPU", lambda s: _fmt(s.server.get("redis_cpu_percent"), "%")),
    ("load CPU", lambda s: _fmt(s.client_cpu_percent, "%")),
    ("refunds", lambda s: _fmt(s.server.get("refunds"))),
    ("reconcile diffs", lambda s: _fmt(s.server.get("reconcile_differences"))),
)


def _fmt(v: Any, unit: str = "") -> str:
    if v is None:
        return "-"
    return f"{v:.0f}{unit}" if isinstance(v, float) else f"{v}{unit}"


def table(stages: list[StageFigures]) -> list[list[str]]:
    return [[name for name, _ in COLUMNS]] + [[cell(s) for _, cell in COLUMNS] for s in stages]


def print_table(rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))


def html_section(stages: list[StageFigures], verdict: str, pictures: list[Path]) -> str:
    rows = table(stages)
    head = "".join(f"<th>{c}</th>" for c in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows[1:])
    images = "".join(
        f'<p><img alt="{p.stem}" src="data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()}"></p>'
        for p in pictures
    )
    return (
        '<div id="redpacket-server-side" style="padding:1em;font-family:sans-serif">'
        "<h2>redpacket: each stage, clients and servers</h2>"
        f"<p>{verdict}</p><table border=1 cellpadding=4 style='border-collapse:collapse'>"
        f"<tr>{head}</tr>{body}</table>{images}</div>"
    )


def add_to_html(path: Path, section: str) -> None:
    text = path.read_text()
    at = text.rfind("</body>")
    path.write_text(text[:at] + section + text[at:] if at >= 0 else text + section)


def plots(report: dict[str, Any], stages: list[StageFigures], out: Path) -> list[Path]:
    from bench import plots as p

    written = [
        p.stage_plot(stages, out / "load-stages.png"),
        p.server_plot(report.get("samples", []), out / "load-server.png"),
    ]
    return [w for w in written if w is not None]


# --- the command ----------------------------------------------------------------------------------------


def _flag(rest: list[str], *names: str) -> str | None:
    for i, a in enumerate(rest):
        for n in names:
            if a == n and i + 1 < len(rest):
                return rest[i + 1]
            if a.startswith(n + "="):
                return a.split("=", 1)[1]
    return None


def run(argv: list[str]) -> int:
    args, rest = parser().parse_known_args(argv)
    if args.group_size < 2:
        raise LoadError("--group-size must be at least 2 (an admin sends, members grab)")
    worker = "--worker" in rest
    fixed_users = _flag(rest, "--users", "-u")
    stages_text = args.stages or (None if fixed_users or worker else DEFAULT_STAGES)
    try:
        stages = parse_stages(stages_text) if stages_text else []
    except ValueError as e:
        raise LoadError(str(e)) from None
    if fixed_users is not None and not fixed_users.isdigit():
        raise LoadError(f"--users {fixed_users!r} is not a number")
    most = max([s.users for s in stages] or [int(fixed_users or 10)])

    if args.prepare:
        data = prepare(args.host, most, args.group_size, args.prefix)
        Path(args.prepare).write_text(json.dumps(data))
        print(
            f"wrote {args.prepare}: {len(data['users'])} users, {len(data['groups'])} groups on {args.host}"
        )
        return 0
    fixture = _fixture(args, most, worker)
    fd, report_path = tempfile.mkstemp(prefix="redpacket-load-report-", suffix=".json")
    os.close(fd)
    step_up = (stages_text or "") if stages and not worker else None
    code = _locust(args, rest, fixture=fixture, report_path=report_path, step_up=step_up, worker=worker)
    if worker:
        return code
    return _report(args, rest, report_path, code)


def _fixture(args: argparse.Namespace, most: int, worker: bool) -> str:
    """The users and groups of the run: ``--fixture``'s (checked), or a file made now for this run."""
    if args.fixture:
        try:
            data = json.loads(Path(args.fixture).read_text())
        except (OSError, ValueError) as e:
            raise LoadError(f"cannot read --fixture {args.fixture}: {e}") from None
        check_fixture(data, args.fixture)
        return str(args.fixture)
    if worker:
        raise LoadError("a Locust worker (--worker) needs --fixture FILE: the file the master's run uses")
    members = max(1, most - math.ceil(most / args.group_size))  # admins count among the users
    print(f"preparing {members} members in groups of {args.group_size} on {args.host} ...", flush=True)
    data = prepare(args.host, members, args.group_size, args.prefix)
    fd, fixture = tempfile.mkstemp(prefix="redpacket-load-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    return fixture


def _locust(
    args: argparse.Namespace,
    rest: list[str],
    *,
    fixture: str,
    report_path: str,
    step_up: str | None,
    worker: bool,
) -> int:
    """Locust on the locustfile, every flag it does not know passed on; its exit code. A fixture made for
    this run is removed after it."""
    command = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--redpacket-fixture", fixture]
    if not worker:
        command += ["--host", args.host, "--redpacket-report", report_path]
    for flag in FORWARDED:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            command += [flag, value]
    if not worker and "--headless" not in rest and not any(a.startswith("--web-host") for a in rest):
        # Without --headless, Locust's web UI starts the run and nothing happens until someone does: on
        # this machine only unless --web-host says otherwise (its default is every interface).
        command += ["--web-host", "127.0.0.1"]
        print(
            "redpacket load: waiting for a start in Locust's web UI, http://127.0.0.1:8089"
            " (--headless runs at once, without it)",
            file=sys.stderr,
        )
    env = dict(os.environ)
    env.pop(STAGES_ENV, None)
    if step_up is not None:
        env[STAGES_ENV] = step_up
    try:
        return subprocess.call([*command, *rest], env=env)
    except KeyboardInterrupt:
        return 130
    finally:
        if fixture != args.fixture:  # the one made for this run
            Path(fixture).unlink(missing_ok=True)


def _report(args: argparse.Namespace, rest: list[str], report_path: str, code: int) -> int:
    """The master's stage report: the table, the knee, plots, the HTML section and the JSON line."""
    try:
        report = json.loads(Path(report_path).read_text() or "{}")
    except ValueError:
        report = {}
    finally:
        Path(report_path).unlink(missing_ok=True)
    figures = [StageFigures.from_dict(d) for d in report.get("stages", [])]
    if not figures:
        print("redpacket load: no stage finished; no report", file=sys.stderr)
        return code or 1
    at, why = knee(figures)
    verdict = f"knee: {why}" if at is not None else why
    print()
    print_table(table(figures))
    print(verdict)
    if args.report:
        Path(args.report).write_text(json.dumps(report))
    pictures: list[Path] = []
    if args.plot:
        out = Path(args.plot)
        out.mkdir(parents=True, exist_ok=True)
        pictures = plots(report, figures, out)
        for picture in pictures:
            print(f"plot: {picture}")
    html = _flag(rest, "--html")
    if html and Path(html).exists():
        add_to_html(Path(html), html_section(figures, verdict, pictures))
    totals = report.get("totals", {})
    won = totals.get("grab won", {}).get("requests", 0)
    print(f"grabs answered won, every one (the stop included): {won}")
    print(
        json.dumps({"load": [f.as_dict() for f in figures], "knee_stage": at, "knee": why, "totals": totals})
    )
    return code
