"""``redpacket bench hook``: what the chat backend's hook (``server.hub.hooks``) costs a send.

The same sends (``packets.send_packet``, equal packets of 2 shares into one group, on the configured Redis
and a throw-away SQLite file) without the hook — the baseline — and with it, alternating, against a
receiver that allows everything: a stock Starlette app on stock uvicorn, as its own process (its CPU is
counted apart). Printed per send: wall time, this process's CPU (the send and the hook's client), the
receiver's CPU, and the hook call's P50 / P99.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.hubbench import cpu_seconds, make_world, server_process
from bench.progress import phase
from bench.report import report
from server.core import open_core
from server.hub.hooks import Hooks
from server.hub.metrics import HubMetrics
from server.money import packets
from server.settings import Settings, child_env

SECRET = "bench-hook-secret-of-at-least-thirty-two-chars"
ROUNDS = 2


async def bench_hook(settings: Settings, sends: int = 2_000, plot: Path | None = None) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="redpacket-bench-"))
    db_url = f"sqlite:///{tmp / 'bench.sqlite3'}"
    admin, group, _ = await make_world(settings, db_url, 3, 10**8)
    figures: dict[str, Any] = {"sends": sends, "rounds": ROUNDS}
    receiver = server_process(
        [sys.executable, "-m", "bench.hookbench"], child_env(), r"receiver on (http://\S+)"
    )
    async with receiver as (url, receiver_pid):
        s = settings.replace(
            database_url=db_url, max_total_cents=10**9, hook_url=url, hook_secret=SECRET, hook_timeout_ms=2000
        )
        async with open_core(s) as core, Hooks(core, HubMetrics()) as hooks:
            seen: dict[str, list[float]] = {
                "off": [],
                "on": [],
                "receiver": [],
                "wall_off": [],
                "wall_on": [],
            }
            calls: list[float] = []
            n = 0
            for r in range(ROUNDS):
                for mode in ("off", "on"):
                    approve = hooks.approve_send if mode == "on" else None
                    cpu, rcpu, start = time.process_time(), cpu_seconds(receiver_pid), time.perf_counter()
                    with phase(f"round {r + 1}: {sends:,} sends, hook {mode}", sends):
                        for _ in range(sends):
                            n += 1
                            t = time.perf_counter()
                            await packets.send_packet(
                                core, sender_id=admin, group_id=group, kind="equal", total=20, count=2,
                                request_id=f"b{n}", approve=approve,
                            )  # fmt: skip
                            if mode == "on":
                                calls.append(time.perf_counter() - t)
                    seen[mode].append((time.process_time() - cpu) * 1e6 / sends)
                    seen[f"wall_{mode}"].append((time.perf_counter() - start) * 1e6 / sends)
                    if mode == "on":
                        seen["receiver"].append((cpu_seconds(receiver_pid) - rcpu) * 1e6 / sends)
    calls.sort()
    figures["send_us_wall_off"] = round(min(seen["wall_off"]))
    figures["send_us_wall_on"] = round(min(seen["wall_on"]))
    figures["cpu_us_per_send_off"] = round(min(seen["off"]))
    figures["cpu_us_per_send_on"] = round(min(seen["on"]))
    figures["receiver_cpu_us_per_send"] = round(min(seen["receiver"]))
    figures["send_with_hook_p50_ms"] = round(statistics.median(calls) * 1000, 2)
    figures["send_with_hook_p99_ms"] = round(calls[int(len(calls) * 0.99) - 1] * 1000, 2)
    return report("hook", figures, plot)


def _serve_receiver() -> None:
    """A hook receiver of stock parts that allows every send: uvicorn + Starlette, as a backend would."""
    import asyncio
    import socket

    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def allow(request: Request) -> JSONResponse:
        await request.body()
        return JSONResponse({"allow": True})

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    print(f"receiver on http://127.0.0.1:{sock.getsockname()[1]}/hook", flush=True)
    app = Starlette(routes=[Route("/hook", allow, methods=["POST"])])
    # (sockets=, not fd=: uvicorn takes an fd for a Unix socket, and its TCP connections then keep
    # Nagle's algorithm on — measured: 44 ms a call, the client's delayed ACK, instead of 1 ms)
    config = uvicorn.Config(app, log_level="warning", access_log=False)
    asyncio.run(uvicorn.Server(config).serve(sockets=[sock]))


if __name__ == "__main__":
    _serve_receiver()
