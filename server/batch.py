"""Coalesce the Redis calls that concurrent requests make in one event-loop tick into one pipeline.

One Python process awaiting one EVALSHA per request tops out near 20k/s; the same calls sent as one
pipeline per tick go several times faster, with the same per-call answers. Each call still gets its own
result or its own exception.

Cancelling a waiting caller does not unsend its command: a grab already in the pipeline still happens in
Redis (the Lua script is atomic either way), exactly as with an unbatched call cancelled mid-flight.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from redis.asyncio.client import Pipeline
from redis.asyncio.client import Redis as _Redis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

Queue = Callable[[Pipeline], object]


class Batcher:
    """Send every call queued during one loop tick as one non-transactional pipeline."""

    def __init__(self, redis: _Redis, max_batch: int = 512) -> None:
        self._redis = redis
        self._max_batch = max_batch
        self._pending: list[tuple[Queue, asyncio.Future[Any]]] = []
        self._scheduled = False
        self._inflight: set[asyncio.Task[None]] = set()
        self.batches = 0
        self.calls = 0

    async def call(self, queue: Queue) -> Any:
        """Queue one command (``queue(pipe)`` adds it to a pipeline) and wait for its own result."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._pending.append((queue, fut))
        if len(self._pending) >= self._max_batch:
            self._flush()
        elif not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._flush)
        return await fut

    async def script(self, script: AsyncScript, keys: list[str], args: list[Any]) -> Any:
        """EVALSHA ``script`` in the next batch. After a SCRIPT FLUSH or a restart the first answer is
        NOSCRIPT (the script did not run), and the call is made again directly, which reloads it."""
        try:
            return await self.call(lambda pipe: pipe.evalsha(script.sha, len(keys), *keys, *args))
        except NoScriptError:
            return await script(keys=keys, args=args)

    def _flush(self) -> None:
        self._scheduled = False
        batch, self._pending = self._pending, []
        if batch:
            task = asyncio.get_running_loop().create_task(self._send(batch))
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)

    async def _send(self, batch: list[tuple[Queue, asyncio.Future[Any]]]) -> None:
        self.batches += 1
        self.calls += len(batch)
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for queue, _ in batch:
                    queue(pipe)
                results = await pipe.execute(raise_on_error=False)
        except Exception as e:
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(e)
            return
        for (_, fut), result in zip(batch, results, strict=True):
            if fut.done():
                continue
            if isinstance(result, Exception):
                fut.set_exception(result)
            else:
                fut.set_result(result)

    async def drain(self) -> None:
        """Wait for every batch already sent."""
        self._flush()
        if self._inflight:
            await asyncio.gather(*self._inflight, return_exceptions=True)
