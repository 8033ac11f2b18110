"""``redpacket bench flood``: what one socket's flood costs everybody else on a hub (``server.hub.wire``).

A ``redpacket serve`` hub with its production limits. Throughout, another user pings it (one request every
20 ms, each round trip timed) and a newcomer opens a socket every half second (time to its welcome). One
user floods from a raw TCP socket, phase after phase, each ``seconds`` long: nothing (the baseline), empty
pings, 125-byte pings, tiny data frames, fragmented continuation frames; a flooder the hub closes comes
back at once, as an attacker would. Printed per phase: the other user's round trip P50 / P99 / max, the
slowest welcome, how often the flooder was closed and with which code, and the hub's CPU.

Then a client sends ``ping_mb`` of pings and reads nothing, and ten such sockets of one user are reopened
for twice ``seconds``: the hub's RSS before, at its peak and 5 s after; both again on a hub without the
frame budget (what bounds them there is the flow control alone).
"""

from __future__ import annotations

import asyncio
import base64
import os
import shutil
import struct
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlparse

import msgpack
from websockets.asyncio.client import connect
from websockets.typing import Subprotocol

from bench import hubbench
from bench.progress import phase
from bench.report import report
from redpacket_client.protocol import SUBPROTOCOL_MSGPACK
from server.settings import Settings

PING, CONT, TEXT, BINARY = 0x9, 0x0, 0x1, 0x2
SUB = [Subprotocol(SUBPROTOCOL_MSGPACK)]


def _frame(opcode: int, payload: bytes = b"", fin: bool = True) -> bytes:
    """A masked client frame, payload under 126 bytes (the mask is zero: the bytes are as given)."""
    return struct.pack("!BB", (0x80 if fin else 0) | opcode, 0x80 | len(payload)) + b"\0\0\0\0" + payload


# Each flood: what opens it on a new socket, then what is sent again and again.
FLOODS: dict[str, tuple[bytes, bytes]] = {
    "empty_pings": (b"", _frame(PING) * 4096),
    "pings_125": (b"", _frame(PING, b"p" * 125) * 256),
    "data_frames": (b"", _frame(BINARY, msgpack.packb({"id": 1, "type": "ping"})) * 2048),
    "continuation": (_frame(BINARY, b"", fin=False), _frame(CONT, b" ", fin=False) * 4096),
}


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(len(ordered) * q))], 1) if ordered else 0.0


async def _raw(ws_url: str, token: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    url = urlparse(ws_url)
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    key = base64.b64encode(os.urandom(16)).decode()
    writer.write(
        f"GET {url.path}?token={token} HTTP/1.1\r\nHost: {url.netloc}\r\nUpgrade: websocket\r\n"
        f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
        f"Sec-WebSocket-Protocol: {SUBPROTOCOL_MSGPACK}\r\n\r\n".encode()
    )
    await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    return reader, writer


async def _closed_with(reader: asyncio.StreamReader) -> int:
    """Read what the hub sends until it ends the connection: its close code (1006: none came)."""
    try:
        while True:
            first, second = await reader.readexactly(2)
            n = second & 0x7F
            if n == 126:
                (n,) = struct.unpack("!H", await reader.readexactly(2))
            elif n == 127:
                (n,) = struct.unpack("!Q", await reader.readexactly(8))
            payload = await reader.readexactly(n)
            if first & 0x0F == 0x8:
                return int(struct.unpack("!H", payload[:2])[0]) if len(payload) >= 2 else 1005
    except (asyncio.IncompleteReadError, ConnectionError):
        return 1006


async def _flood(
    ws_url: str, token: str, flood: tuple[bytes, bytes], until: float, closes: Counter[int]
) -> None:
    """Send the flood again and again until ``until``; when the hub closes the socket, open another."""
    opener, data = flood
    while time.perf_counter() < until:
        try:
            reader, writer = await _raw(ws_url, token)
        except (OSError, TimeoutError, asyncio.IncompleteReadError):
            await asyncio.sleep(0.05)
            continue
        ended = asyncio.create_task(_closed_with(reader))
        writer.write(opener)
        try:
            while time.perf_counter() < until and not ended.done():
                writer.write(data)
                await asyncio.wait({ended, asyncio.ensure_future(writer.drain())}, timeout=0.5)
        except (ConnectionError, RuntimeError):  # (uvloop: a write on a closed transport)
            pass
        writer.transport.abort()
        closes[await ended] += 1


async def _victim(ws_url: str, token: str, stop: asyncio.Event, rtts: list[tuple[float, float]]) -> None:
    """Another user's ping every 20 ms: (when, round trip in ms)."""
    async with connect(f"{ws_url}?token={token}", subprotocols=SUB, compression=None) as ws:
        await ws.recv()  # welcome
        i = 0
        while not stop.is_set():
            i += 1
            asked = time.perf_counter()
            await ws.send(msgpack.packb({"id": i, "type": "ping"}))
            while msgpack.unpackb(cast(bytes, await ws.recv())).get("id") != i:
                pass
            rtts.append((asked, (time.perf_counter() - asked) * 1000))
            await asyncio.sleep(max(0.0, asked + 0.02 - time.perf_counter()))


async def _newcomers(
    ws_url: str, tokens: list[str], stop: asyncio.Event, waits: list[tuple[float, float]]
) -> None:
    """A new socket every half second: (when, ms to its welcome)."""
    n = 0
    while not stop.is_set():
        asked = time.perf_counter()
        async with connect(
            f"{ws_url}?token={tokens[n % len(tokens)]}", subprotocols=SUB, compression=None, open_timeout=30
        ) as ws:
            await ws.recv()
        waits.append((asked, (time.perf_counter() - asked) * 1000))
        n += 1
        await asyncio.sleep(max(0.0, asked + 0.5 - time.perf_counter()))


async def _deaf_pinger(ws_url: str, token: str, megabytes: int) -> tuple[int, int]:
    """Send ``megabytes`` of 125-byte pings, reading nothing, until the hub ends the socket or stops
    reading it (a write that waits 5 s); then drop it. The bytes sent and the hub's close code (1006: none
    read, or the socket was dropped first)."""
    reader, writer = await _raw(ws_url, token)
    chunk = FLOODS["pings_125"][1]
    sent = 0
    try:
        while sent < megabytes * 1024 * 1024:
            writer.write(chunk)
            await asyncio.wait_for(writer.drain(), 5)
            sent += len(chunk)
    except (ConnectionError, TimeoutError, RuntimeError):  # (uvloop: a write on a closed transport)
        pass
    code = 1006
    if writer.transport.is_closing() or reader.at_eof():
        code = await asyncio.wait_for(_closed_with(reader), 30)
    writer.transport.abort()
    return sent, code


async def _deaf_pingers(ws_url: str, token: str, megabytes: int, seconds: float) -> int:
    """Ten deaf pingers of one user, each opened again as soon as it ends, for ``seconds``: how many ran."""
    until, runs = time.perf_counter() + seconds, 0

    async def one() -> None:
        nonlocal runs
        while time.perf_counter() < until:
            try:
                await _deaf_pinger(ws_url, token, megabytes)
            except (OSError, TimeoutError, RuntimeError, asyncio.IncompleteReadError):
                await asyncio.sleep(0.1)  # refused (its user's ten slots taken): again
            runs += 1

    await asyncio.gather(*(one() for _ in range(10)))
    return runs


async def bench_flood(settings: Settings, seconds: float = 15.0, ping_mb: int = 50) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="redpacket-bench-"))
    db_url = f"sqlite:///{tmp / 'bench.sqlite3'}"
    try:
        _, _, ids = await hubbench.make_world(settings, db_url, 24, 10**6)
        victim, flooder, deaf, *others = [hubbench.token(u) for u in ids[1:]]
        figures: dict[str, Any] = {"seconds_per_phase": seconds}
        limits = {  # the production limits this bench is about (the bench hub's others stay out of the way)
            "REDPACKET_WS_FRAMES_PER_SECOND": str(Settings().ws_frames_per_second),
            "REDPACKET_WS_BYTES_PER_SECOND": str(Settings().ws_bytes_per_second),
            "REDPACKET_MSGS_PER_SECOND": str(Settings().msgs_per_second),
            "REDPACKET_MSGS_BURST": str(Settings().msgs_burst),
        }
        async with hubbench.hub_process(settings, db_url, 1, **limits) as (ws_url, pid):
            stop = asyncio.Event()
            rtts: list[tuple[float, float]] = []
            waits: list[tuple[float, float]] = []
            watchers = [
                asyncio.create_task(_victim(ws_url, victim, stop, rtts)),
                asyncio.create_task(_newcomers(ws_url, others, stop, waits)),
            ]
            try:
                for name in ["quiet", *FLOODS]:
                    closes: Counter[int] = Counter()
                    cpu, start = hubbench.cpu_seconds(pid), time.perf_counter()
                    until = start + seconds
                    with phase(f"{name} ({seconds:g} s)"):
                        if name == "quiet":
                            await asyncio.sleep(seconds)
                        else:
                            await _flood(ws_url, flooder, FLOODS[name], until, closes)
                    end = time.perf_counter()
                    mine = [ms for at, ms in rtts if start <= at < end]
                    welcomes = [ms for at, ms in waits if start <= at < end]
                    figures[f"{name}_other_rtt_p50_ms"] = _p(mine, 0.5)
                    figures[f"{name}_other_rtt_p99_ms"] = _p(mine, 0.99)
                    figures[f"{name}_other_rtt_max_ms"] = round(max(mine, default=0.0), 1)
                    figures[f"{name}_slowest_welcome_ms"] = round(max(welcomes, default=0.0), 1)
                    figures[f"{name}_flooder_closed"] = dict(closes)
                    figures[f"{name}_hub_cpu_percent"] = round(
                        (hubbench.cpu_seconds(pid) - cpu) / (end - start) * 100
                    )
            finally:
                stop.set()
                for t in watchers:
                    await t
            await _deaf(figures, "deaf", ws_url, pid, deaf, ping_mb, seconds)
        # The same without the frame budget: what bounds a deaf pinger then is the flow control alone.
        no_budget = {**limits, "REDPACKET_WS_FRAMES_PER_SECOND": str(10**9)}
        async with hubbench.hub_process(settings, db_url, 1, **no_budget) as (ws_url, pid):
            await _deaf(figures, "deaf_no_frame_budget", ws_url, pid, deaf, ping_mb, seconds)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return report("flood", figures)


async def _deaf(
    figures: dict[str, Any], name: str, ws_url: str, pid: int, token: str, megabytes: int, seconds: float
) -> None:
    """One deaf pinger, then ten of one user reopened for twice ``seconds``: the hub's RSS (KB) before,
    at its peak and 5 s after each."""
    rss = hubbench.memory_kb(pid, "VmRSS")
    with phase(f"{name}: a client sending {megabytes} MB of pings, reading nothing"):
        sent, code = await _deaf_pinger(ws_url, token, megabytes)
    await asyncio.sleep(5)
    figures[f"{name}_sent_mb"] = round(sent / 1024 / 1024, 1)
    figures[f"{name}_closed_with"] = code
    figures[f"{name}_rss_before_kb"] = rss
    figures[f"{name}_rss_peak_kb"] = hubbench.memory_kb(pid, "VmHWM")
    figures[f"{name}_rss_5s_after_kb"] = hubbench.memory_kb(pid, "VmRSS")
    with phase(f"{name}: ten such sockets of one user, reopened for {2 * seconds:g} s"):
        figures[f"{name}_ten_runs"] = await _deaf_pingers(ws_url, token, megabytes, 2 * seconds)
    await asyncio.sleep(5)
    figures[f"{name}_ten_rss_peak_kb"] = hubbench.memory_kb(pid, "VmHWM")
    figures[f"{name}_ten_rss_5s_after_kb"] = hubbench.memory_kb(pid, "VmRSS")
