"""A ``redis-server`` of a test's own, on a free port, with AOF on: to kill, restart, or cut back as an
OS crash would, while the shared Redis on 6379 stays untouched."""

from __future__ import annotations

import asyncio
import shutil
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import redis

from tests.hubtools import free_port

needs_redis_server = pytest.mark.skipif(
    shutil.which("redis-server") is None, reason="needs redis-server to start, kill and restart one"
)


class RedisProcess:
    def __init__(self, directory: Path, *extra: str) -> None:
        self.dir = directory
        self.port = free_port()
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> None:
        """Start it and wait (bounded) until it answers PING with its data loaded."""
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
                "--save", "", "--appendonly", "yes", "--appendfsync", "everysec", *self.extra]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL)  # noqa: ASYNC220 - a few per test
        deadline = time.monotonic() + 30
        while not await asyncio.to_thread(self._answers):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise AssertionError(f"redis-server on port {self.port} did not come up")
            await asyncio.sleep(0.02)

    def _answers(self) -> bool:
        try:
            return bool(redis.Redis(port=self.port, socket_connect_timeout=0.5).ping())
        except redis.RedisError:
            return False

    async def kill(self) -> None:
        """SIGKILL: what was written to the OS survives in the AOF; nothing is saved on the way out."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        await asyncio.to_thread(self.proc.wait, 30)

    async def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            await asyncio.to_thread(self.proc.wait, 30)


@asynccontextmanager
async def redis_process(directory: Path, *extra: str) -> AsyncIterator[RedisProcess]:
    r = RedisProcess(directory, *extra)
    await r.start()
    try:
        yield r
    finally:
        await r.stop()
