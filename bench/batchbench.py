"""``redpacket bench batcher``: this process's CPU per Redis call through the hub's batcher
(``server.store.batch``: one tick's calls in one pipeline, read within one bound), beside the same calls
coalesced the same way but sent with redis-py's own ``Pipeline.execute`` (the stock parts, and what the
batcher sent with before issue 46). The same callers, the same one-key script, alternating rounds; a
figure is the median of its rounds."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

from redis.asyncio import Redis
from redis.commands.core import AsyncScript

from bench.progress import phase
from bench.redisfloor import FLOOR_SCRIPT
from bench.report import report
from server.settings import Settings
from server.store.batch import Batcher
from server.store.redisnodes import RedisNodes

ARGS = ["a", "b", "c", "d", "e", "f", "g", "h"]  # a grab's eight arguments


class StockPipelines:
    """The calls of one loop tick in one redis-py pipeline, each caller given its own answer."""

    def __init__(self, client: Redis) -> None:
        self.client = client
        self.pending: list[tuple[tuple[Any, ...], asyncio.Future[Any]]] = []
        self.batches = 0
        self.calls = 0
        self.sending: set[asyncio.Task[None]] = set()

    async def script(self, script: AsyncScript, keys: list[str], args: list[Any]) -> Any:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if not self.pending:
            asyncio.get_running_loop().call_soon(self._start)
        self.pending.append((("EVALSHA", script.sha, len(keys), *keys, *args), fut))
        return await fut

    def _start(self) -> None:
        task = asyncio.ensure_future(self._send())
        self.sending.add(task)
        task.add_done_callback(self.sending.discard)

    async def _send(self) -> None:
        batch, self.pending = self.pending, []
        self.batches += 1
        self.calls += len(batch)
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for command, _ in batch:
                    pipe.execute_command(*command)
                answers = await pipe.execute(raise_on_error=False)
        except Exception as e:  # no caller left waiting
            for _, fut in batch:
                fut.set_exception(e)
            return
        for (_, fut), answer in zip(batch, answers, strict=True):
            fut.set_result(answer)


Caller = Callable[[AsyncScript, list[str], list[Any]], Awaitable[Any]]


async def _round(call: Caller, script: AsyncScript, callers: int, each: int) -> float:
    """``callers`` coroutines make ``each`` calls one after another: this process's CPU per call (µs)."""

    async def caller(i: int) -> None:
        keys = [f"redpacket:bench:batcher:{i}"]
        for _ in range(each):
            await call(script, keys, ARGS)

    began = time.process_time()
    await asyncio.gather(*(caller(i) for i in range(callers)))
    return (time.process_time() - began) * 1e6 / (callers * each)


async def bench_batcher(
    settings: Settings, callers: int = 100, each: int = 300, rounds: int = 6
) -> dict[str, Any]:
    nodes = await RedisNodes(settings.redis_url, 64).open()
    try:
        script = nodes.client.register_script(FLOOR_SCRIPT)
        await script(keys=["redpacket:bench:batcher"])  # loaded before the clock starts
        batcher, stock = Batcher(nodes), StockPipelines(nodes.client)
        sides: dict[str, Caller] = {
            "batcher": lambda s, k, a: batcher.script(s, k, a),
            "stock": stock.script,
        }
        spent: dict[str, list[float]] = {name: [] for name in sides}
        with phase(f"{rounds} rounds of {callers} callers x {each} calls on each side", rounds):
            for r in range(rounds):
                for name in sides if r % 2 == 0 else reversed(list(sides)):
                    spent[name].append(await _round(sides[name], script, callers, each))
    finally:
        await nodes.aclose()
    figures: dict[str, Any] = {"callers": callers, "calls_per_round": callers * each, "rounds": rounds}
    for name, runs in spent.items():
        figures[f"{name}_cpu_us_per_call"] = round(statistics.median(runs), 2)
        figures[f"{name}_cpu_us_per_call_rounds"] = [round(x, 2) for x in runs]
    figures["batcher_calls_per_pipeline"] = round(batcher.calls / max(1, batcher.batches), 1)
    figures["stock_calls_per_pipeline"] = round(stock.calls / max(1, stock.batches), 1)
    figures["ratio"] = round(figures["batcher_cpu_us_per_call"] / figures["stock_cpu_us_per_call"], 2)
    return report("batcher", figures)
