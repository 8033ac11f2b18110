"""Hub benchmarks: ``redpacket bench hub-grab | fanout | hot``. Each prints a table and a JSON line.

Every figure is compared with a baseline measured in the same run on the same machine: a bare Starlette
websocket app on stock uvicorn (its own default protocols, compression off as on the hub; echo for round
trips, an encode-once send loop for fan-out), driven by the same client code. Hubs run as separate
``redpacket serve`` processes on the configured Redis and a throw-away SQLite file.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgpack
from starlette.applications import Starlette
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket
from websockets.asyncio.client import ClientConnection, connect
from websockets.typing import Subprotocol

from bench.grabbench import fresh_ids
from bench.hubmetrics import http_url_of, pipelined
from bench.progress import phase
from bench.redisfloor import redis_floor
from bench.report import report
from redpacket_client.protocol import SUBPROTOCOL_MSGPACK
from server.core import open_core
from server.hub.tokens import make_token
from server.ids import GroupId, PacketId, UserId
from server.live import announce, events
from server.money import groups, ledger, packets
from server.settings import Settings, child_env
from server.store.redisnodes import RedisNodes

SECRET = "bench-secret-of-at-least-thirty-two-chars"


def _tree(pid: int) -> list[int]:
    """A process and its descendants (a hub run with ``--workers`` is a supervisor and its workers)."""
    pids, i = [pid], 0
    while i < len(pids):
        try:
            children = Path(f"/proc/{pids[i]}/task/{pids[i]}/children").read_text().split()
        except OSError:
            children = []
        pids += [int(c) for c in children]
        i += 1
    return pids


def cpu_seconds(pid: int) -> float:
    """User + system CPU a process and its descendants have used, from /proc."""
    total = 0.0
    for p in _tree(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


async def redis_cpu_seconds(nodes: RedisNodes) -> float:
    """CPU seconds used so far by every master of the configured Redis (one server, or a cluster's)."""
    return sum((await nodes.cpu_seconds()).values())


def memory_kb(pid: int, field: str) -> int:
    """A memory figure of a process and its descendants from /proc: VmRSS (now) or VmHWM (peak)."""
    total = 0
    for p in _tree(pid):
        try:
            lines = Path(f"/proc/{p}/status").read_text().splitlines()
        except OSError:
            continue
        total += sum(int(line.split()[1]) for line in lines if line.startswith(field + ":"))
    return total


STARTUP_SECONDS = 120.0  # how long a bench server may take to say it listens


@asynccontextmanager
async def server_process(
    args: list[str], env: dict[str, str], pattern: str
) -> AsyncIterator[tuple[str, int]]:
    """A server process whose output says its URL (``pattern``'s group 1) once it listens, read by a thread
    of its own: a bench of more servers than the loop's default pool has threads (six here) would fill it."""
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # noqa: ASYNC220
    out, loop = proc.stdout, asyncio.get_running_loop()
    assert out is not None  # (stdout=PIPE)
    listening: asyncio.Future[str] = loop.create_future()
    ended: asyncio.Future[str] = loop.create_future()

    def settle(f: asyncio.Future[str], value: str | BaseException) -> None:
        if not f.done():
            f.set_exception(value) if isinstance(value, BaseException) else f.set_result(value)

    def read() -> None:
        lines: list[str] = []
        url = None
        for line in out:
            lines.append(line)
            m = None if url is not None else re.search(pattern, line)
            if m is not None:
                url, lines = m.group(1), []
                loop.call_soon_threadsafe(settle, listening, url)
        if url is None:
            failed = RuntimeError("server did not start:\n" + "".join(lines))
            loop.call_soon_threadsafe(settle, listening, failed)
        loop.call_soon_threadsafe(settle, ended, "".join(lines))

    threading.Thread(target=read, name=f"bench-server-{proc.pid}", daemon=True).start()
    try:
        url = await asyncio.wait_for(asyncio.shield(listening), STARTUP_SECONDS)
        yield url, proc.pid
    finally:
        proc.terminate()
        try:
            await asyncio.to_thread(proc.wait, 60)
        except subprocess.TimeoutExpired:
            proc.kill()
        listening.cancel()  # (never read when the start ran out: no "exception never retrieved")
        output = await asyncio.wait_for(asyncio.shield(ended), 10)  # (a child may hold the pipe)
        out.close()  # (read to its end by now)
        said = [line for line in output.splitlines() if " WARNING " in line or " ERROR " in line]
        if said:  # what the server complained of during the bench (its errors say why figures look off)
            print(f"  ({len(said)} warning/error lines from the server; the first: {said[0][:300]})")


def hub_env(settings: Settings, db_url: str, **extra: str) -> dict[str, str]:
    """A bench hub's environment: its limits out of the way, then ``extra`` (which may put one back)."""
    values = dict(
        REDPACKET_REDIS_URL=settings.redis_url,
        REDPACKET_QUEUE_REDIS_URL=settings.queue_redis_url,
        REDPACKET_GRAB_DURABILITY=settings.grab_durability,
        REDPACKET_DATABASE_URL=db_url,
        REDPACKET_SECRET=SECRET,
        REDPACKET_QUEUE_NAME="redpacket:bench:queue",
        REDPACKET_MAX_COUNT="1000",
        REDPACKET_MAX_TOTAL_CENTS=str(10**9),
        REDPACKET_GRABS_PER_SECOND="1000000",
        REDPACKET_GRABS_BURST="1000000",
        REDPACKET_MSGS_PER_SECOND="1000000",
        REDPACKET_MSGS_BURST="1000000",
        REDPACKET_USER_MSGS_PER_SECOND="1000000",
        REDPACKET_USER_MSGS_BURST="1000000",
        REDPACKET_WS_FRAMES_PER_SECOND="1000000",
        REDPACKET_WS_BYTES_PER_SECOND=str(10**9),
        REDPACKET_SEND_QUEUE_FRAMES="100000",
        REDPACKET_PRESENCE_EVENT_LIMIT="0",
    )
    values.update(extra)
    return child_env(**values)


def hub_process(settings: Settings, db_url: str, workers: int = 1, **extra: str) -> Any:
    return server_process(
        [sys.executable, "-m", "server", "serve", "--port", "0", "--workers", str(workers)],
        hub_env(settings, db_url, **extra),
        r"websocket (ws://\S+)",
    )


def bare_process(mode: str) -> Any:
    return server_process([sys.executable, "-m", "bench.hubbench", mode], child_env(), r"bare on (ws://\S+)")


async def make_world(
    settings: Settings, db_url: str, users: int, topup: int
) -> tuple[UserId, GroupId, list[UserId]]:
    """Users (the first is the admin), one group with all of them, money for the admin."""
    s = settings.replace(database_url=db_url, max_count=1000, max_total_cents=10**9)
    async with open_core(s) as core:
        await fresh_ids(core)
        ids: list[UserId] = []
        for i in range(0, users, 5000):
            ids += await ledger.create_users(core.db, [f"b{n}" for n in range(i, min(i + 5000, users))])
        await ledger.topup(core.db, ids[0], topup, "bench")
        group = await groups.create_group(core.db, ids[0], "bench")
        await groups.add_members(core.db, core.membership, group, ids[1:])
    return ids[0], group, ids


def token(user: int) -> str:
    return make_token(SECRET.encode(), user, int(time.time()), 3600)


async def send_packets(
    settings: Settings,
    db_url: str,
    *,
    admin: UserId,
    group: GroupId,
    n: int,
    count: int,
    announced: bool = False,
) -> list[PacketId]:
    """``n`` equal packets of ``count`` shares; ``announced``: put up and shown to the room as a hub's
    send does (else only saved)."""
    s = settings.replace(database_url=db_url, max_count=max(1000, count), max_total_cents=10**9)
    ids = []
    async with open_core(s) as core:
        for _ in range(n):
            p = await packets.send_packet(
                core, sender_id=admin, group_id=group, kind="equal", total=count * 10, count=count
            )
            if announced and await announce.announce_packet(core, p) is None:
                raise RuntimeError("the bench packet could not be announced")
            ids.append(p.packet_id)
    return ids


# -- bench hub-grab ------------------------------------------------------------------------------------


# Packets made per second a --seconds run may grab for: above what one hub process answers here (about
# 5,000-8,000 grabs a second of 100-share packets), so the packets never run out before the time does.
PACKETS_PER_SECOND = 120


async def bench_hub_grab(
    settings: Settings,
    connections: int = 100,
    packets_n: int = 40,
    workers: int = 1,
    plot: Path | None = None,
    seconds: float | None = None,
) -> dict[str, Any]:
    """Hub CPU per grab and per ping beside a bare echo's, the same raw client on every side. Without
    ``seconds``: ``packets_n`` round trips per connection and phase; with it, each phase (grab, ping,
    echo) runs that long — long enough to profile the hub (its pid and each phase are said on stderr)."""
    tmp = Path(tempfile.mkdtemp(prefix="redpacket-bench-"))
    db_url = f"sqlite:///{tmp / 'bench.sqlite3'}"
    if seconds is not None:
        packets_n = max(packets_n, int(seconds * PACKETS_PER_SECOND))
    admin, group, ids = await make_world(settings, db_url, connections + 1, 10**8)
    with phase(f"sending {packets_n:,} packets of {connections} shares", packets_n):
        pids = await send_packets(settings, db_url, admin=admin, group=group, n=packets_n, count=connections)
    figures: dict[str, Any] = {"connections": connections, "workers": workers, "seconds": seconds}
    # The same raw client on both sides: send one msgpack frame, read one frame back and decode it.
    sub = [Subprotocol(SUBPROTOCOL_MSGPACK)]
    done = {"n": 0}

    async def lane(ws: ClientConnection, frames: list[bytes], hub: str | None, until: float) -> None:
        """``hub``: what every reply must be ("grab": a win, "ping": ok); None for the echo. Stops at
        ``until`` (perf_counter) or when its frames run out; with a time to run, pings and echoes go
        round their frames again (a grab cannot: each packet is grabbed once per user)."""
        again = until != float("inf") and hub != "grab"
        for frame in itertools.cycle(frames) if again else frames:
            if time.perf_counter() >= until:
                return
            await ws.send(frame)
            raw = await ws.recv()  # binary frames: the msgpack subprotocol
            reply = msgpack.unpackb(raw if isinstance(raw, bytes) else raw.encode())
            if hub and not (reply.get("ok") and (hub == "ping" or reply["data"]["outcome"] == "won")):
                raise RuntimeError(f"bench {hub} answered {reply}")
            done["n"] += 1

    def deadline() -> float:
        return time.perf_counter() + seconds if seconds is not None else float("inf")

    grab_frames = [
        msgpack.packb({"id": i, "type": "grab", "group": group, "packet": p}) for i, p in enumerate(pids)
    ]
    # The hub's cheapest request (no Redis, no database) through the same session machinery.
    ping_frames = [msgpack.packb({"id": i, "type": "ping"}) for i in range(packets_n)]
    redis = await RedisNodes(settings.redis_url, 4).open()
    async with hub_process(settings, db_url, workers) as (ws_url, hub_pid):
        conns = [
            await connect(f"{ws_url}?token={token(u)}", subprotocols=sub, compression=None) for u in ids[1:]
        ]
        for ws in conns:
            await ws.recv()  # welcome; no sync, so no group events are sent to these sockets
        http_url = http_url_of(ws_url)
        for kind, frames in (("grab", grab_frames), ("ping", ping_frames)):
            piped = pipelined(http_url) if kind == "grab" and workers == 1 else None
            cpu, redis_cpu = cpu_seconds(hub_pid), await redis_cpu_seconds(redis)
            done["n"], start, until = 0, time.perf_counter(), deadline()
            with phase(f"hub {kind}s (hub pid {hub_pid})"):
                await asyncio.gather(*(lane(ws, frames, kind, until) for ws in conns))
            n = done["n"]
            figures[f"hub_{kind}s"] = n
            figures[f"hub_{kind}s_per_s"] = round(n / (time.perf_counter() - start))
            # CPU per round trip: where the time goes on a machine whose two cores all of it shares.
            figures[f"hub_cpu_us_per_{kind}"] = round((cpu_seconds(hub_pid) - cpu) * 1e6 / n)
            redis_used = await redis_cpu_seconds(redis) - redis_cpu
            figures[f"redis_cpu_us_per_{kind}"] = round(redis_used * 1e6 / n)
            if piped is not None:  # (one process answers /metrics: with --workers, not all of them)
                pipelines, calls = (b - a for a, b in zip(piped, pipelined(http_url), strict=True))
                figures["hub_redis_calls_per_pipeline"] = round(calls / max(pipelines, 1), 1)
        for ws in conns:
            await ws.close()
    await redis.aclose()
    # What the least script costs Redis in pipelines as deep as the grabs' (issue 46's floor): known with
    # one hub process only (with --workers, /metrics is one worker's).
    if "hub_redis_calls_per_pipeline" in figures:
        depth = max(1, round(figures["hub_redis_calls_per_pipeline"]))
        with phase(f"Redis's floor: a one-key script, {depth} to a pipeline"):
            figures.update(await redis_floor(settings.redis_url, depth, seconds or 2.0))
        floor = figures["redis_floor_cpu_us_per_call"]
        figures["redis_grab_to_floor"] = round(figures["redis_cpu_us_per_grab"] / max(floor, 0.1), 1)
    async with bare_process("echo") as (ws_url, bare_pid):
        conns = [await connect(ws_url, compression=None) for _ in range(connections)]
        cpu = cpu_seconds(bare_pid)
        done["n"], start, until = 0, time.perf_counter(), deadline()
        with phase(f"bare echo (pid {bare_pid})"):
            await asyncio.gather(*(lane(ws, grab_frames, None, until) for ws in conns))
        n = done["n"]
        figures["bare_echoes"] = n
        figures["bare_echo_per_s"] = round(n / (time.perf_counter() - start))
        figures["bare_cpu_us_per_echo"] = round((cpu_seconds(bare_pid) - cpu) * 1e6 / n)
        for ws in conns:
            await ws.close()
    figures["ratio"] = round(figures["hub_grabs_per_s"] / figures["bare_echo_per_s"], 3)
    figures["ping_ratio"] = round(figures["hub_pings_per_s"] / figures["bare_echo_per_s"], 3)
    return report("hub-grab", figures, plot)


# -- bench fanout --------------------------------------------------------------------------------------


async def _receive_all(conns: list[ClientConnection], n: int) -> float:
    async def drain(ws: ClientConnection) -> None:
        for _ in range(n):
            await ws.recv()

    await asyncio.gather(*(drain(ws) for ws in conns))
    return time.perf_counter()


async def bench_fanout(
    settings: Settings, members: int = 500, events_n: int = 200, plot: Path | None = None
) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="redpacket-bench-"))
    db_url = f"sqlite:///{tmp / 'bench.sqlite3'}"
    _, group, ids = await make_world(settings, db_url, members, 1)
    figures: dict[str, Any] = {"members": members, "events": events_n, "deliveries": members * events_n}
    async with hub_process(settings, db_url) as (ws_url, _):
        # Raw sockets on both sides: the client does the same work per frame (receive, no decode).
        sub = [Subprotocol(SUBPROTOCOL_MSGPACK)]
        conns = [await connect(f"{ws_url}?token={token(u)}", subprotocols=sub, compression=None) for u in ids]
        sync = msgpack.packb({"id": 1, "type": "sync", "groups": {str(group): None}})
        for ws in conns:
            await ws.recv()  # welcome
            await ws.send(sync)
            await ws.recv()  # the sync reply
        s = settings.replace(database_url=db_url)
        async with open_core(s) as core:
            start = time.perf_counter()
            for i in range(events_n):
                await events.publish(core, group, "chat", {"user": 1, "text": f"event {i}"})
            await _receive_all(conns, events_n)
        figures["hub_deliveries_per_s"] = round(members * events_n / (time.perf_counter() - start))
        for ws in conns:
            await ws.close()
    async with bare_process("broadcast") as (ws_url, _):
        conns = [await connect(f"{ws_url}?n={members}", compression=None) for _ in range(members)]
        start = time.perf_counter()
        await conns[0].send(json.dumps({"events": events_n}))
        await _receive_all(conns, events_n)
        figures["bare_broadcast_per_s"] = round(members * events_n / (time.perf_counter() - start))
        for ws in conns:
            await ws.close()
    figures["ratio"] = round(figures["hub_deliveries_per_s"] / figures["bare_broadcast_per_s"], 3)
    return report("fanout", figures, plot)


# -- the bare baselines, run as their own process ----------------------------------------------------------


def _bare_app(mode: str) -> Starlette:
    conns: list[WebSocket] = []
    ready = asyncio.Event()

    async def echo(ws: WebSocket) -> None:
        await ws.accept()
        while True:
            message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            await ws.send_bytes(message.get("bytes") or b"")

    async def broadcast(ws: WebSocket) -> None:
        await ws.accept()
        expected = int(ws.query_params.get("n", "1"))
        conns.append(ws)
        if len(conns) == expected:
            ready.set()
        while True:
            message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            if message.get("text"):
                await ready.wait()
                n = json.loads(message["text"])["events"]
                for i in range(n):
                    # The same frame encoded once, sent to every connection in a plain loop.
                    frame = msgpack.packb(
                        {
                            "type": "event",
                            "group": 1,
                            "offset": f"{i}-0",
                            "event": "chat",
                            "data": {"user": 1, "text": f"event {i}"},
                        }
                    )
                    for c in conns:
                        await c.send_bytes(frame)

    return Starlette(routes=[WebSocketRoute("/ws", echo if mode == "echo" else broadcast)])


def _serve_bare(mode: str) -> None:
    import socket

    import uvicorn
    import uvloop

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen(2048)
    # Stock uvicorn and Starlette: uvicorn's own default protocols (httptools, websockets-sansio), not the
    # hub's; compression off as on the hub (uvicorn's default is on) and pings as rare.
    config = uvicorn.Config(
        _bare_app(mode),
        ws_per_message_deflate=False,
        ws_ping_interval=120,
        log_level="warning",
        access_log=False,
    )
    print(f"bare on ws://127.0.0.1:{sock.getsockname()[1]}/ws", flush=True)
    uvloop.run(uvicorn.Server(config).serve(sockets=[sock]))


if __name__ == "__main__":
    _serve_bare(sys.argv[1])
