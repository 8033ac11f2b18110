"""Stopping tasks (``server.stopping``): a cancel that ``asyncio.wait_for`` swallows still ends our loops,
and every stop is bounded."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from pathlib import Path

import pytest

from server import stopping
from server.stopping import check_cancelled, child, stop, waits_at


async def _wait_for_then_go_round(
    answers: list[object], futures: list[asyncio.Future[object]], guard: bool
) -> None:
    """A loop as ours are: one call through ``wait_for`` per round (redis-py sends every command so)."""
    loop = asyncio.get_running_loop()
    while True:
        if guard:
            check_cancelled()
        fut: asyncio.Future[object] = loop.create_future()
        futures.append(fut)
        answers.append(await asyncio.wait_for(fut, 60))


async def _run_until_swallowed(guard: bool) -> tuple[asyncio.Task[None], list[object]]:
    """The loop's first call answered in the same turn as its task is cancelled."""
    answers: list[object] = []
    futures: list[asyncio.Future[object]] = []
    task = asyncio.create_task(_wait_for_then_go_round(answers, futures, guard))
    for _ in range(3):  # its first round started; wait_for waiting on the answer
        await asyncio.sleep(0)
    assert len(futures) == 1
    futures[0].set_result("answer")
    task.cancel()
    await asyncio.wait([task], timeout=1)
    return task, answers


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="Python 3.12's wait_for no longer swallows a cancel")
async def test_a_cancel_wait_for_swallowed_still_ends_a_loop_that_checks() -> None:
    """The cancel was swallowed (the loop got its answer after being cancelled), and the loop still ended
    at the top of its next round; the same loop without the check goes round and waits again."""
    task, answers = await _run_until_swallowed(guard=True)
    assert answers == ["answer"]  # wait_for answered after the cancel: the dangerous state, seen
    assert task.cancelled()
    unguarded, answers = await _run_until_swallowed(guard=False)
    assert answers == ["answer"] and not unguarded.done()  # round again, waiting: what hung `up`
    assert await stop([unguarded], "the unguarded loop", within=1, again_every=0.05)


async def _ignores_cancels(ended: asyncio.Event, times: int, until: asyncio.Event | None = None) -> None:
    """Takes ``times`` cancels for nothing (and every one while ``until`` is given and not set) before it
    ends; sets ``ended`` when it does."""
    taken = 0
    try:
        while True:
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                taken += 1
                if taken > times and (until is None or until.is_set()):
                    raise
    finally:
        ended.set()


async def test_a_stop_is_bounded_and_names_the_task_left(caplog: pytest.LogCaptureFixture) -> None:
    ended, let_go = asyncio.Event(), asyncio.Event()
    stubborn = asyncio.create_task(_ignores_cancels(ended, 0, let_go), name="stubborn")
    quick = asyncio.create_task(asyncio.sleep(60))
    await asyncio.sleep(0)
    with caplog.at_level(logging.ERROR, logger="server.stopping"):
        assert not await stop([stubborn, quick], "the test's tasks", within=0.2)
    assert quick.cancelled() and not stubborn.done()
    assert "the test's tasks: 1 task(s) still running" in caplog.text and "stubborn" in caplog.text
    let_go.set()
    assert await stop([stubborn], "the stubborn task, let go", within=5)


async def test_again_every_ends_code_that_swallows_a_cancel() -> None:
    """Once is not enough for a task that swallows the first cancel (arq's loop); cancelled again, it ends.
    Cancelled once only, it is still running at the bound."""
    for again, ends in ((None, False), (0.05, True)):
        ended = asyncio.Event()
        task = asyncio.create_task(_ignores_cancels(ended, 1))
        await asyncio.sleep(0)
        assert await stop([task], "a swallower", within=0.5, again_every=again) is ends
        assert ended.is_set() is ends
        if not ends:
            assert await stop([task], "a swallower", within=5)


async def test_a_stopped_tasks_failure_is_retrieved_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    async def fails() -> None:
        raise RuntimeError("its own end")

    task = asyncio.create_task(fails())
    await asyncio.wait([task])
    assert await stop([task], "a failed task")
    assert "never retrieved" not in caplog.text


@contextlib.asynccontextmanager
async def _holding(until: asyncio.Event) -> object:
    try:
        yield
    finally:
        await until.wait()


async def test_where_a_stuck_task_waits_is_said_through_async_with_blocks() -> None:
    """The drain budget's dump (``server.cli.serve``) names each task's chain of coroutines, through
    ``asynccontextmanager`` exits — where `redpacket up`'s stop was stuck, and all a one-line print
    showed was the outermost frame."""
    until, inside = asyncio.Event(), asyncio.Event()

    async def lifespan() -> None:
        async with _holding(until):
            inside.set()

    task = asyncio.create_task(lifespan())
    await inside.wait()
    await asyncio.sleep(0)  # (on to the exit's wait)
    chain = waits_at(task)
    assert chain.startswith(
        "test_where_a_stuck_task_waits_is_said_through_async_with_blocks.<locals>.lifespan"
    )
    assert "_holding test_stopping.py" in chain and "Event.wait" in chain
    until.set()
    await task


async def test_a_child_hands_back_its_exit_code_and_what_it_wrote() -> None:
    code, out, err = await child(
        [sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"],
        {},
        "test",
    )
    assert (code, out, err) == (3, b"out\n", b"err\n")


@pytest.mark.parametrize("hears_sigterm", [True, False])
async def test_a_child_is_stopped_with_its_caller(
    hears_sigterm: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelled, ``child`` stops the process before it returns: asked (SIGTERM), or, one that ignores
    that, killed after ``STOP_SECONDS``. A reconciliation the worker gave up on does not read on beside
    the credits."""
    monkeypatch.setattr(stopping, "STOP_SECONDS", 0.5)
    said = tmp_path / "pid"
    os.mkfifo(said)  # (the child says its pid there once it is running: opened, it waits for the other end)
    ignore = "" if hears_sigterm else "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    script = (
        f"import os, signal, time; {ignore}open({str(said)!r}, 'w').write(str(os.getpid())); time.sleep(3600)"
    )
    job = asyncio.ensure_future(child([sys.executable, "-c", script], {}, "test"))
    pid = int(await asyncio.wait_for(asyncio.to_thread(said.read_text), 30))
    job.cancel()
    done, _ = await asyncio.wait([job], timeout=30)  # (a child never stopped: failed here, not hung)
    assert done and job.cancelled()
    with pytest.raises(ProcessLookupError):  # (waited for: no zombie left either)
        os.kill(pid, 0)
