"""The ``redpacket`` command line: every command and its flags (``redpacket load`` parses its own)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="redpacket",
        description="Live red packets in group chat: the hub, the worker, and the operator's tools.",
        epilog="Settings come from REDPACKET_* environment variables (docs/configuration.md). Without"
        " REDPACKET_REDIS_URL and REDPACKET_DATABASE_URL, `up` and the operator's commands run on an"
        " embedded Valkey and a SQLite file under REDPACKET_DATA_DIR (.redpacket); `serve` and `worker`"
        " need both named (REDPACKET_REDIS_URL=embedded and a sqlite:/// URL for those).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _system(sub)
    _add(sub, "migrate", help="apply database migrations (every start does this too)")
    rec_all = _add(sub, "reconcile", help="check every cent; print a report; exit 1 on any difference")
    rec_all.add_argument(
        "--json",
        action="store_true",
        help="print the report as one JSON object (figures, ok, each difference) instead of lines",
    )
    blocks = _add(sub, "blocks", help="list the users the bot detector blocked, and why and until when")
    blocks.add_argument(
        "--lift", type=int, metavar="USER", help="lift the block (and throttle) of this user id"
    )
    hooks = _add(sub, "webhooks", help="the webhook queue: how far each URL is; replay events")
    hooks_sub = hooks.add_subparsers(dest="webhooks_command", required=True, metavar="ACTION")
    _add(hooks_sub, "status", help="per URL: deliveries pending, failed, the oldest pending")
    replay = _add(
        hooks_sub,
        "replay",
        help="send events again to every URL (the same ids: a receiver drops those it has)",
    )
    since = replay.add_mutually_exclusive_group(required=True)
    since.add_argument(
        "--since", metavar="TIME", help="events created at or after TIME (ISO 8601, e.g. 2026-12-01T08:00Z)"
    )
    since.add_argument("--after", type=int, metavar="EVENT_ID", help="events after this event id")
    rec = _add(sub, "recover", help="rebuild packets' Redis state from the database (safe while grabs go on)")
    rec.add_argument(
        "packet_ids", type=int, nargs="+", metavar="PACKET_ID", help="a packet whose Redis state to rebuild"
    )
    ver = _add(
        sub, "verify", help="check a packet's proof of a fair split (docs/protocol.md, Provably fair packets)"
    )
    ver.add_argument("packet_id", type=int, metavar="PACKET_ID", help="the packet to check")
    ver.add_argument(
        "--commitment",
        metavar="HEX",
        help="the commitment a member kept from the send (reply or packet event): checked against it",
    )
    # Parsed by bench.load (every flag it does not know goes to Locust): listed here for --help only.
    _add(
        sub,
        "load",
        add_help=False,
        help="Locust step-up load against a hub (redpacket load --help; docs/load.md)",
    )
    _bench(sub)
    return parser


def _add(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str, **options: Any
) -> argparse.ArgumentParser:
    """A subcommand whose own ``--help`` starts with what the list of commands says of it."""
    what = str(options.get("help", ""))
    return sub.add_parser(name, description=what[:1].upper() + what[1:] + ".", **options)


def _listen_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", help="address to listen on (default: REDPACKET_HOST or 127.0.0.1)")
    p.add_argument(
        "--port", type=int, help="port to listen on, 0 for any free one (default: REDPACKET_PORT or 8000)"
    )


def _system(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The commands that run the system: ``up``, ``serve`` and ``worker``."""
    _listen_options(
        _add(sub, "up", help="the hub and a worker in one process, dev login and demo money on (a demo)")
    )
    serve = _add(sub, "serve", help="the hub only (production; needs REDPACKET_SECRET; run workers apart)")
    _listen_options(serve)
    serve.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="hub processes sharing the listening socket, one core each (default 1)",
    )
    serve.add_argument(
        "--check", action="store_true", help="exit 0 if this host's hub answers /healthz (its port)"
    )
    wk = _add(
        sub, "worker", help="the worker: credits, refunds, announcements, sweeper, reconciliation, bots"
    )
    wk.add_argument(
        "--check", action="store_true", help="exit 0 if this host's worker is healthy (its metrics port)"
    )


def _bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bench = _add(sub, "bench", help="print benchmark figures and a JSON line (docs/benchmarks.md)")
    bench.add_argument(
        "what",
        choices=[
            "grab",
            "hub-grab",
            "batcher",
            "flood",
            "frames",
            "fanout",
            "hot",
            "credit",
            "storm",
            "db-read",
            "tokens",
            "split",
            "tracing",
            "grab-script",
            "hook",
        ],
    )
    bench.add_argument("--grabs", type=int, default=20_000, help="grabs per measured mode (grab)")
    bench.add_argument("--clients", type=int, default=10_000, help="connected clients (hot)")
    bench.add_argument(
        "--workers", type=int, default=1, help="hub processes: serve --workers (hub-grab, hot)"
    )
    bench.add_argument(
        "--hubs",
        type=int,
        default=1,
        help="hot: separate hub processes (and as many bare echo processes), each on its own port, for a"
        " room past one process's ~20,000 sockets",
    )
    bench.add_argument(
        "--client-procs",
        type=int,
        default=1,
        help="load client processes (hot; at least one per hub, and one per 16,000 clients)",
    )
    bench.add_argument("--rate", type=int, default=2_000, help="grabs per second (storm)")
    bench.add_argument(
        "--seconds",
        type=float,
        help="how long the grabs go on (storm: 30 unless given); hub-grab: how long each phase runs"
        " (unless given, 4,000 round trips); flood: each flood's (15 unless given)",
    )
    bench.add_argument(
        "--reconcile-at",
        type=float,
        metavar="S",
        help="storm: S seconds into the grabs, ask the worker for a reconciliation (its job, as every"
        " tenth minute)",
    )
    bench.add_argument("--plot", metavar="DIR", help="write PNG plots of the run into DIR")
    bench.add_argument(
        "--galera",
        action="store_true",
        help="credit, storm: also on a throw-away 3-node Galera cluster started for the run (galera-4)",
    )
    bench.add_argument(
        "--spider",
        action="store_true",
        help="credit: also on a throw-away MariaDB Spider head over 1, 2 and 3 backends (a sharded ledger),"
        " --rounds rounds alternating, --credits credits a round",
    )
    bench.add_argument(
        "--credits", type=int, default=20_000, metavar="N", help="credit --spider: credits a round and side"
    )
    bench.add_argument(
        "--kill-writer-after",
        type=float,
        default=5.0,
        metavar="S",
        help="storm --galera: kill -9 the writer node this many seconds into the grabs (default 5)",
    )
    script = bench.add_argument_group("grab-script (a throw-away redis-server of its own)")
    script.add_argument(
        "--script", action="append", type=Path, default=[], metavar="LUA",
        help="a variant of lua/grab.lua to measure (repeat; default lua/grab.lua)",
    )  # fmt: skip
    script.add_argument("--rounds", type=int, default=3, help="runs of each variant, alternating")
    script.add_argument("--ablations", action="store_true", help="and each command stubbed in turn")
    script.add_argument(
        "--instructions", action="store_true", help="count instructions under valgrind's callgrind"
    )
    script.add_argument(
        "--redis-setup", default="plain",
        choices=["plain", "aof", "replica", "cluster", "cluster-aof-replica"],
        help="what the server carries: plain (no persistence), aof, replica, cluster (mode), or all",
    )  # fmt: skip
    script.add_argument(
        "--redis-config", action="append", default=[], metavar="'NAME VALUE'",
        help="a server option, e.g. 'hash-max-listpack-entries 128' (repeat)",
    )  # fmt: skip
