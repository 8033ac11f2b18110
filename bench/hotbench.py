"""``redpacket bench hot``: 10,000 clients (or 100,000: ``--hubs``) grab one 1,000-share packet at once,
against a bare echo burst of the same clients in the same run; then a worker credits the grabs and the
books are reconciled.

The client must be faster than what it measures, so it is not ``HubClient``: each client process
(``--client-procs``) is ``bench.hotclient`` (picows, a websocket client in Cython). The driver
(this process) tells the client processes what to do over their stdin/stdout and gathers what they
measured; times are ``time.monotonic`` (one clock for every process on the machine).

In one run, with the same clients:

1. **echo**: connect every client to a bare Starlette echo app (same uvicorn settings), then every
   client sends one frame at once; a reply is the frame coming back.
2. **hub**: connect every client to ``redpacket serve`` (``--workers``), each syncs the group (so each
   also receives the room's announcements), then every client sends a grab of the packet at once.
3. **credit**: a ``redpacket worker`` credits every share handed out; ``reconcile`` reads the books.

With ``hubs`` (N > 1) each side is N processes of its own on one Redis and one database — N hubs, N
bare echo servers — each on its own port, every client process talking to one of them (as many client
processes per server): a process may hold at most ~20,000 sockets here (its open-file limit), so a
100,000-member room needs several on each side.

Printed: connect time, all-replies time and reply P50 / P99 of both and their ratios; CPU of the server,
the client processes and Redis per phase (who was the limit), and per request; RSS per idle connection;
the longest garbage-collector pause in the hub during the burst (one hub); what the room was sent;
over-issue from the database; the shares handed out and credited; the reconciliation's verdict.
"""

from __future__ import annotations

import asyncio
import json
import resource
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import msgpack

from bench import hotbooks, hubbench, hubmetrics, plots
from bench.progress import phase
from bench.report import report
from server.ids import GroupId, PacketId, UserId
from server.settings import Settings
from server.store.redisnodes import RedisNodes

# -- the driver ------------------------------------------------------------------------------------------


class ClientProcs:
    """The client processes: each owns a slice of the clients and answers one JSON line per command."""

    def __init__(self, n: int) -> None:
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-m", "bench.hotclient"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for _ in range(n)
        ]
        # Each process's answer is read by a thread of its own: in the default executor (six threads
        # here) the servers' log drains (``hubbench.server_process``, one per server) could take every
        # thread, and no answer would ever be read.
        self.readers = ThreadPoolExecutor(max_workers=n, thread_name_prefix="bench-hot-client")

    async def ask(self, commands: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """One command to each process (in order), and each one's answer."""
        for proc, command in zip(self.procs, commands, strict=True):
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(command) + "\n")
            proc.stdin.flush()

        def answer(proc: subprocess.Popen[str]) -> dict[str, Any]:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError("a bench client process died (its error is above)")
            # (json.loads is typed Any; a client process's line is a JSON object.)
            return json.loads(line)  # type: ignore[no-any-return]

        loop = asyncio.get_running_loop()
        return list(
            await asyncio.gather(*(loop.run_in_executor(self.readers, answer, p) for p in self.procs))
        )

    async def close(self) -> None:
        for proc in self.procs:
            if proc.stdin is not None:
                proc.stdin.close()
        for proc in self.procs:
            await asyncio.to_thread(proc.wait, 60)
            if proc.stdout is not None:
                proc.stdout.close()
        self.readers.shutdown()


def _slices(items: list[Any], n: int) -> list[list[Any]]:
    return [items[i::n] for i in range(n)]


def _gc_pauses(http_url: str) -> dict[str, float]:
    """The hub's garbage-collector pauses so far (``redpacket_hub_gc_pause_seconds``): how many, their
    total, how many took over 10 ms, and the longest ever."""
    read = hubmetrics.hub_metrics(http_url)

    def value(pattern: str) -> float:  # (0 for what is not there yet)
        return read(pattern) or 0.0

    count = value(r"^redpacket_hub_gc_pause_seconds_count (\S+)$")
    return {
        "n": count,
        "s": value(r"^redpacket_hub_gc_pause_seconds_sum (\S+)$"),
        "over_10ms": count - value(r'^redpacket_hub_gc_pause_seconds_bucket\{le="0.01"\} (\S+)$'),
        "max": value(r"^redpacket_hub_gc_pause_max_seconds (\S+)$"),
    }


# Opening handshakes in flight from all the client processes together (one process's 500 before 100k).
HANDSHAKES = 500


# A process holds at most as many sockets as its open-file limit allows (20,000 here): a client process
# takes this share of it, and a hub is refused more clients than that share too.
def sockets_per_process() -> int:
    return int(resource.getrlimit(resource.RLIMIT_NOFILE)[0] * 0.8)


def room_problem(clients_n: int, hubs: int, workers: int) -> str | None:
    """Why the room cannot be held by this many server processes here, or None."""
    if hubs > 1 and workers > 1:
        return "bench hot runs --hubs separate hub processes or one serve --workers, not both"
    each = sockets_per_process()
    if clients_n > each * max(hubs, workers):
        return (
            f"{clients_n:,} clients need more than {max(hubs, workers)} server process(es): each holds at"
            f" most {each:,} sockets here (its open-file limit); give --hubs"
        )
    return None


def client_procs_for(clients_n: int, asked: int, servers: int) -> int:
    """How many client processes a run takes: at least ``asked``, one per server, and enough that none
    holds more than ``sockets_per_process()`` sockets; a multiple of ``servers``, so that each server gets
    as many clients."""
    n = max(asked, servers, -(-clients_n // sockets_per_process()))
    return -(-n // servers) * servers


def _cpu(pids: list[int]) -> float:
    return sum(hubbench.cpu_seconds(p) for p in pids)


def _memory_kb(pids: list[int], field: str) -> int:
    return sum(hubbench.memory_kb(p, field) for p in pids)


async def _burst(
    clients: ClientProcs, frame: bytes, pids: list[int], redis: RedisNodes | None, wait_finished: bool
) -> dict[str, Any]:
    """Every client sends ``frame`` at once; the figures of the replies and who spent what (``pids``: the
    servers)."""
    cpu = _cpu(pids)
    redis_cpu = await hubbench.redis_cpu_seconds(redis) if redis else 0.0
    command = {"cmd": "burst", "frame": frame.hex(), "wait_finished": wait_finished}
    answers = await clients.ask([command] * len(clients.procs))
    server_cpu = _cpu(pids) - cpu
    latencies = sorted(x for a in answers for x in a["latencies_ms"])
    went = min(a["went"] for a in answers)
    # Each reply: when it came (s after the first frame went) and how long it took (ms), for the plots.
    points = [
        (at - went, ms) for a in answers for at, ms in zip(a["replied_at"], a["latencies_ms"], strict=True)
    ]
    outcomes: dict[str, int] = {}
    for a in answers:
        for k, v in a["outcomes"].items():
            outcomes[k] = outcomes.get(k, 0) + v
    n = len(latencies)
    figures = {
        "all_replies_s": round(max(a["last_reply"] for a in answers) - min(a["went"] for a in answers), 3),
        "reply_p50_ms": round(statistics.median(latencies), 1),
        "reply_p99_ms": round(latencies[max(0, int(n * 0.99) - 1)], 1),
        "server_cpu_s": round(server_cpu, 2),
        "server_cpu_us_per_request": round(server_cpu * 1e6 / n, 1),
        "client_cpu_s": round(sum(a["cpu"] for a in answers), 2),
        "outcomes": outcomes,
        "frames_received": sum(a["frames"] for a in answers),
        "finished_received": sum(a["finished"] for a in answers),
        "points": points,
    }
    if redis is not None:
        figures["redis_cpu_s"] = round(await hubbench.redis_cpu_seconds(redis) - redis_cpu, 2)
    return figures


async def _phase(clients: ClientProcs, commands: list[dict[str, Any]], pids: list[int]) -> dict[str, Any]:
    """A phase every client process runs (connect, sync): how long it took, the CPU of each side."""
    cpu = _cpu(pids)
    answers = await clients.ask(commands)
    return {
        "s": round(max(a["done"] for a in answers) - min(a["began"] for a in answers), 2),
        "server_cpu_s": round(_cpu(pids) - cpu, 2),
        "client_cpu_s": round(sum(a["cpu"] for a in answers), 2),
        "retries": sum(a.get("retries", 0) for a in answers),
    }


async def _connect(
    clients: ClientProcs, urls: list[str], tokens: list[str] | int, pids: list[int]
) -> dict[str, float]:
    """Client process ``i`` connects its slice of the clients to ``urls[i % len(urls)]``, with
    ``HANDSHAKES`` in flight in all (a share each)."""
    n = len(clients.procs)
    parts = (
        _slices(tokens, n) if isinstance(tokens, list) else [tokens // n + (i < tokens % n) for i in range(n)]
    )
    window = max(1, HANDSHAKES // n)
    commands = [
        {"cmd": "connect", "url": urls[i % len(urls)], "tokens": p, "window": window}
        for i, p in enumerate(parts)
    ]
    return await _phase(clients, commands, pids)


async def bench_hot(
    settings: Settings,
    clients_n: int = 10_000,
    shares: int = 1_000,
    workers: int = 1,
    client_procs: int = 1,
    hubs: int = 1,
    plot: Path | None = None,
) -> dict[str, Any]:
    """The burst on each side, then the credits and the reconciliation (module docstring). ``hubs``:
    separate hub processes (and as many echo processes); ``workers``: one ``serve --workers``."""
    problem = room_problem(clients_n, hubs, workers)
    if problem is not None:
        raise ValueError(problem)
    shares = min(shares, clients_n)  # a packet has at most as many shares as the group has members
    client_procs = client_procs_for(clients_n, client_procs, hubs)
    tmp = Path(tempfile.mkdtemp(prefix="redpacket-bench-"))
    db_url = f"sqlite:///{tmp / 'bench.sqlite3'}"
    with phase(f"making {clients_n:,} users in one group"):
        world = await hubbench.make_world(settings, db_url, clients_n + 1, 10**8)
    admin, group, _ = world
    figures: dict[str, Any] = {"clients": clients_n, "shares": shares, "workers": workers, "hubs": hubs}
    figures["client_procs"] = client_procs
    clients = ClientProcs(client_procs)
    try:
        echo = await _echo(clients, clients_n, hubs, figures)
        hub, packet_id = await _hub(
            settings, db_url, world, clients, clients_n=clients_n, shares=shares, figures=figures
        )
    finally:
        await clients.close()
    figures["ratio_connect"] = round(figures["hub_connect_s"] / figures["echo_connect_s"], 2)
    figures["ratio_all_replies"] = round(figures["hub_all_replies_s"] / figures["echo_all_replies_s"], 2)
    figures["ratio_p99"] = round(figures["hub_reply_p99_ms"] / max(figures["echo_p99_ms"], 0.1), 2)
    # (CPU is read from /proc in 10 ms ticks: a small run's echo may show none, and then no ratio)
    echo_cpu = figures["echo_server_cpu_us_per_request"]
    figures["ratio_cpu_per_request"] = (
        round(figures["hub_server_cpu_us_per_request"] / echo_cpu, 2) if echo_cpu else None
    )
    client_cpu = figures["hub_client_cpu_s"] / client_procs
    figures["limit"] = "client" if client_cpu > figures["hub_server_cpu_s"] / max(workers, hubs) else "hub"
    figures.update(await hotbooks.paid(settings, db_url, packet_id=packet_id, group=group, admin=admin))
    figures.update(await hotbooks.credited(settings, db_url, tmp, packet_id=packet_id, group=group))
    report("hot", figures)
    if plot is not None:
        title = f"{clients_n:,} clients grab one {shares:,}-share packet"
        plots.said(
            [
                plots.latency(
                    [p[1] for p in hub["points"]],
                    plot / "hot-latency.png",
                    f"{title}: reply latency",
                    [p[1] for p in echo["points"]],
                    ("hub: grab", "bare echo, same clients"),
                ),
                plots.latency_over_time(hub["points"], plot / "hot-latency-over-time.png", title),
            ]
        )
    return figures


async def _echo(
    clients: ClientProcs, clients_n: int, servers: int, figures: dict[str, Any]
) -> dict[str, Any]:
    """1. The bare echo (``servers`` processes): connecting, then one frame from every client at once."""
    async with AsyncExitStack() as stack:
        started = [await stack.enter_async_context(hubbench.bare_process("echo")) for _ in range(servers)]
        urls, pids = [u for u, _ in started], [p for _, p in started]
        with phase(f"echo: connecting {clients_n:,} clients"):
            connect = await _connect(clients, urls, clients_n, pids)
        figures["echo_connect_s"] = connect["s"]
        figures["echo_connect_server_cpu_s"] = connect["server_cpu_s"]
        figures["echo_connect_client_cpu_s"] = connect["client_cpu_s"]
        figures["echo_connect_retries"] = connect["retries"]
        with phase(f"echo: a frame from each of {clients_n:,} clients"):
            echo = await _burst(clients, msgpack.packb({"id": 1, "type": "ping"}), pids, None, False)
        await clients.ask([{"cmd": "close"}] * len(clients.procs))
    figures["echo_all_replies_s"] = echo["all_replies_s"]
    figures["echo_p50_ms"], figures["echo_p99_ms"] = echo["reply_p50_ms"], echo["reply_p99_ms"]
    figures["echo_server_cpu_s"], figures["echo_client_cpu_s"] = (
        echo["server_cpu_s"],
        echo["client_cpu_s"],
    )
    figures["echo_server_cpu_us_per_request"] = echo["server_cpu_us_per_request"]
    return echo


async def _hub(
    settings: Settings,
    db_url: str,
    world: tuple[UserId, GroupId, list[UserId]],
    clients: ClientProcs,
    *,
    clients_n: int,
    shares: int,
    figures: dict[str, Any],
) -> tuple[dict[str, Any], PacketId]:
    """2. The hub: the same clients, synced to the group, grab one packet at once. The burst's figures
    and the packet."""
    admin, group, ids = world
    workers, hubs, procs = figures["workers"], figures["hubs"], len(clients.procs)
    extra = {"REDPACKET_WS_PING_INTERVAL": "120"}
    async with AsyncExitStack() as stack:
        redis = await RedisNodes(settings.redis_url, 4).open()
        stack.push_async_callback(redis.aclose)
        started = [
            await stack.enter_async_context(hubbench.hub_process(settings, db_url, workers, **extra))
            for _ in range(hubs)
        ]
        urls, pids = [u for u, _ in started], [p for _, p in started]
        http_urls = [hubmetrics.http_url_of(u) for u in urls]
        http_url = http_urls[0]
        await asyncio.sleep(0.5 if workers > 1 else 0)  # every worker is listening (each says so)
        rss_empty = _memory_kb(pids, "VmRSS")
        tokens = [hubbench.token(u) for u in ids[1:]]
        with phase(f"hub: connecting {clients_n:,} clients"):
            connect = await _connect(clients, urls, tokens, pids)
        figures["hub_connect_s"] = connect["s"]
        figures["hub_connect_server_cpu_s"] = connect["server_cpu_s"]
        figures["hub_connect_client_cpu_s"] = connect["client_cpu_s"]
        figures["hub_connect_retries"] = connect["retries"]
        # Then every client syncs the group (the hub sends it the room's events from then on).
        with phase(f"hub: {clients_n:,} clients sync the group"):
            sync = await _phase(clients, [{"cmd": "sync", "group": group}] * procs, pids)
        figures["hub_sync_s"] = sync["s"]
        figures["hub_sync_server_cpu_s"] = sync["server_cpu_s"]
        # The sockets each hub holds, as it counts them (with --workers: the process that answered).
        figures["hub_connections"] = [
            int(hubmetrics.hub_metrics(u)(r"^redpacket_hub_connections (\S+)$") or 0) for u in http_urls
        ]
        rss_idle = _memory_kb(pids, "VmRSS")
        figures["rss_per_connection_kb"] = round((rss_idle - rss_empty) / clients_n, 1)
        (packet_id,) = await hubbench.send_packets(
            settings, db_url, admin=admin, group=group, n=1, count=shares, announced=True
        )
        # Every client has been shown the packet before the burst (as a person would be).
        await clients.ask([{"cmd": "await_packet"}] * procs)
        single = workers == 1 and hubs == 1  # one process answers /metrics: its figures are its own
        gc_before = _gc_pauses(http_url) if single else None
        frame = msgpack.packb({"id": 1, "type": "grab", "group": group, "packet": packet_id})
        with phase(f"hub: {clients_n:,} grabs of one {shares:,}-share packet"):
            hub = await _burst(clients, frame, pids, redis, True)
        figures.update({f"hub_{k}": v for k, v in hub.items() if k not in ("outcomes", "points")})
        figures["outcomes"] = hub["outcomes"]
        if gc_before is not None:
            figures.update(_gc_in_burst(gc_before, _gc_pauses(http_url)))
        figures["hub_rss_peak_mb"] = round(_memory_kb(pids, "VmHWM") / 1024, 1)
        await clients.ask([{"cmd": "close"}] * procs)
    return hub, packet_id


def _gc_in_burst(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    return {
        "hub_gc_pauses_in_burst": int(after["n"] - before["n"]),
        "hub_gc_ms_in_burst": round((after["s"] - before["s"]) * 1000, 1),
        "hub_gc_pauses_over_10ms_in_burst": int(after["over_10ms"] - before["over_10ms"]),
        "hub_gc_longest_pause_ever_ms": round(after["max"] * 1000, 1),
    }
