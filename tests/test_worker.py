"""The worker process's own surface: its health check for compose, arq's command, how its crons fail."""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import worker.main as worker_main
from server.core import Core
from server.money import grabs, packets
from server.money.ledger import balance
from server.settings import Settings
from tests.conftest import make_world
from tests.dbproxy import core_behind_proxy
from tests.hubtools import eventually, free_port, worker_env
from worker.main import running_worker
from worker.metrics import WorkerMetrics


async def _check(s: Settings, metrics_port: int) -> int:
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "server", "worker", "--check"],
        env=worker_env(s, metrics_port),
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done.returncode


async def test_worker_check_reports_the_worker_of_this_host_not_any_worker(core: Core) -> None:
    s = core.settings
    ports = [free_port(), free_port()]
    workers = [
        subprocess.Popen(  # noqa: ASYNC220 - two worker processes for the test
            [sys.executable, "-m", "server", "worker"],
            env=worker_env(s, port),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for port in ports
    ]
    try:
        for port in ports:
            await eventually(lambda p=port: _healthy(s, p), timeout=60)  # type: ignore[misc]
        workers[0].kill()
        await asyncio.to_thread(workers[0].wait, 30)
        # The first one's check fails although another worker is healthy: it asks its own worker.
        assert await _check(s, ports[0]) == 1
        assert await _check(s, ports[1]) == 0
    finally:
        for w in workers:
            w.kill()
            await asyncio.to_thread(w.wait, 30)


async def _healthy(s: Settings, port: int) -> bool:
    return await _check(s, port) == 0


async def test_arq_can_run_the_worker_settings_and_they_pay_credits(core: Core) -> None:
    import importlib
    import os

    from arq.worker import create_worker

    os.environ["REDPACKET_REDIS_URL"] = core.settings.redis_url
    os.environ["REDPACKET_DATABASE_URL"] = core.settings.database_url
    os.environ["REDPACKET_QUEUE_NAME"] = core.settings.queue_name
    try:
        # (In a thread: the module reads the deployment's namespace from the database with asyncio.run,
        # as it does when arq's command imports it, before any loop runs.)
        settings_module = await asyncio.to_thread(
            lambda: importlib.reload(importlib.import_module("worker.settings"))
        )
    finally:
        for k in (
            "REDPACKET_REDIS_URL",
            "REDPACKET_DATABASE_URL",
            "REDPACKET_QUEUE_NAME",
        ):
            del os.environ[k]
    ws = settings_module.WorkerSettings
    assert ws.queue_name == core.queue_name == f"{core.settings.queue_name}:{core.namespace}"
    names = {c.name for c in create_worker(ws, handle_signals=False).cron_jobs}
    ns = core.namespace
    assert {f"{ns}:refund_expired_job", f"{ns}:announce_job", f"{ns}:sweep_job"} <= names
    w = await make_world(core, members=1, admin_cents=10_000)
    p = await packets.send_packet(core, sender_id=w.admin, group_id=w.group, kind="lucky", total=321, count=1)
    await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=w.members[0])
    ctx: dict[str, object] = {}
    await ws.on_startup(ctx)  # what arq calls first: it starts the credit drain
    try:
        await eventually(lambda: _balance_is(core, w.members[0], 321), timeout=30)
    finally:
        await ws.on_shutdown(ctx)


async def _balance_is(core: Core, user: int, cents: int) -> bool:
    return await balance(core.db, user) == cents


@pytest.mark.parametrize("core", ["mysql"], indirect=True)
async def test_a_database_outage_is_two_lines_of_the_workers_log(
    core: Core, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: a worker whose database was cut for 15 s wrote 49 lines, "working again" every second while
    it was still down, and "took over 10 credit(s) another worker left unpaid" of its own credits. Now:
    one line when it goes, one when the heartbeat reaches it again, the credits paid once after."""
    async with core_behind_proxy(core) as (c, proxy):
        w = await make_world(c, members=3, admin_cents=10_000)
        p = await packets.send_packet(
            c, sender_id=w.admin, group_id=w.group, kind="equal", total=300, count=3
        )
        for member in w.members:  # credits waiting: the drain fails on them while the database is away
            await grabs.grab(c, packet_id=p.packet_id, group_id=w.group, user_id=member)
        proxy.go_down()
        with caplog.at_level(logging.INFO):
            async with running_worker(c) as metrics:
                await eventually(lambda: metrics.drain_failures._value.get() >= 5, 60)  # the state
                assert all([await _balance_is(core, m, 0) for m in w.members])
                proxy.restore()
                await eventually(lambda: all_paid(core, w.members, 100), 60)
                await eventually(lambda: "the database is back" in caplog.text, 60)
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert [m for m in said if "database" in m] == [
        next(m for m in said if m.startswith("the database is unavailable (")),
        next(m for m in said if m.startswith("the database is back after ")),
    ], said
    assert not [m for m in said if "working again" in m or "took over" in m or "retried" in m], said


async def all_paid(core: Core, users: list[int], cents: int) -> bool:
    return all([await _balance_is(core, u, cents) for u in users])


async def test_the_worker_stops_when_arqs_loop_swallows_a_cancel(
    core: Core, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On Python 3.11 a cancel that meets one of redis-py's read timeouts is taken for the timeout and
    swallowed; arq's loop then polls on, and ``redpacket up`` hung on Ctrl-C (seen three times under load).
    Here arq's start-up swallows the cancel on purpose: the worker must stop all the same."""
    swallowed = asyncio.Event()
    waiting = asyncio.Event()

    async def stubborn_startup(ctx: dict[str, Any]) -> None:
        try:
            waiting.set()
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            swallowed.set()  # and arq's loop goes on to poll, as after the swallowed timeout

    real = worker_main.make_worker
    monkeypatch.setattr(worker_main, "make_worker", lambda c, m: real(c, m, on_startup=stubborn_startup))
    task = asyncio.create_task(worker_main.run_arq(core, WorkerMetrics(own_process=False)))
    await asyncio.wait_for(waiting.wait(), 30)
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=30)
    assert swallowed.is_set()  # the dangerous state: a cancel arq's loop did not take
    assert done == {task} and task.cancelled()


# A worker process whose stop leaves a task that takes no cancel: ``uvloop.run`` cancels what is left once
# and waits on it without a bound. (A cancel landing while uvloop spawns the reconciliation's child can
# block the loop's thread itself: MagicStack/uvloop#118.)
_STUBBORN_WORKER = """
import asyncio, sys
import worker.main
real = worker.main.stop
async def stop_leaving_a_stubborn_task(tasks, what, **kw):
    async def stubborn():
        print("a stubborn task runs", file=sys.stderr, flush=True)
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                pass
    if what == "the worker":
        asyncio.get_running_loop().create_task(stubborn(), name="stubborn")
    return await real(tasks, what, **kw)
worker.main.stop = stop_leaving_a_stubborn_task
from server.cli import main
main(["worker"])
"""


async def test_a_worker_whose_stop_hangs_says_where_and_ends_within_its_budget(
    core: Core, tmp_path: Path
) -> None:
    said = tmp_path / "worker.err"
    env = {**worker_env(core.settings), "REDPACKET_SHUTDOWN_SECONDS": "1"}  # (10 s: the least it takes)
    with said.open("w") as err:
        proc = subprocess.Popen(  # noqa: ASYNC220 - the worker under test
            [sys.executable, "-c", _STUBBORN_WORKER], env=env, stdout=subprocess.DEVNULL, stderr=err
        )
    try:
        await eventually(lambda: _has(said, "worker running"), timeout=60)
        proc.send_signal(signal.SIGTERM)
        await eventually(lambda: _has(said, "a stubborn task runs"), timeout=30)  # the dangerous state
        code = await asyncio.to_thread(proc.wait, 60)
        text = await asyncio.to_thread(said.read_text)
        assert code == 1, text
        assert "still running while stopping" in text and "  stubborn: " in text, text  # where it waits
        assert "Timeout (0:00:10)!" in text, text  # and every thread's stack, from faulthandler
    finally:
        proc.kill()
        await asyncio.to_thread(proc.wait, 30)


async def _has(path: Path, line: str) -> bool:
    return line in await asyncio.to_thread(path.read_text)
