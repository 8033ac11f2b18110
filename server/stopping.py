"""Stopping background tasks, with a bound.

One cancel is not always the end of a task on Python 3.11: ``asyncio.wait_for`` returns its inner result
when a cancel arrives in the same turn as that result (``except CancelledError: if fut.done(): return
fut.result()``), and redis-py sends every command through ``wait_for`` once a socket timeout is set (ours
always are). A loop that goes round again after that ran for ever, and so did the shutdown waiting on it:
``redpacket up`` did not stop on Ctrl-C in CI, its worker's tasks still running 45 s later. The cancel is
still counted on the task (``Task.cancelling()``), so every loop of ours that runs until cancelled calls
``check_cancelled()`` each round, and every stop is bounded and names what did not stop. Work run apart,
on a thread and a loop of its own (``apart``), is stopped the same way: cancelled there, waited for up to
``STOP_SECONDS``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

STOP_SECONDS = 5.0  # how long a stop waits for the tasks it cancelled before saying so and going on


def check_cancelled() -> None:
    """Raise ``CancelledError`` if this task was asked to stop and is still running (its cancel swallowed
    on the way: see the module's note). Called at the top of each round of a loop that runs until
    cancelled."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def stop(
    tasks: Iterable[asyncio.Future[Any]],
    what: str,
    within: float = STOP_SECONDS,
    again_every: float | None = None,
) -> bool:
    """Cancel ``tasks`` and wait until they have ended, at most ``within`` seconds; True if they all did.
    Those still running then are named in a line and left. ``again_every``: cancel those still running
    again at that interval, for code not ours that checks nothing (arq's loop); our own loops are
    cancelled once, so a cleanup of theirs in a ``finally`` is never interrupted. Their exceptions are
    retrieved (a stopped task's end is not the stopper's business)."""
    tasks = list(tasks)
    pending = {t for t in tasks if not t.done()}
    for t in pending:
        t.cancel()
        t.add_done_callback(_retrieve)  # (also when this stop is itself cancelled before they end)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while pending and (left := deadline - loop.time()) > 0:
        _done, pending = await asyncio.wait(
            pending, timeout=left if again_every is None else min(left, again_every)
        )
        if again_every is not None:
            for t in pending:
                t.cancel()
    for t in tasks:
        _retrieve(t)
    if pending:
        log.error(
            "%s: %d task(s) still running %g s after being cancelled; left: %s",
            what,
            len(pending),
            within,
            ", ".join(sorted(repr(t) for t in pending)),
        )
    return not pending


def _retrieve(t: asyncio.Future[Any]) -> None:
    if t.done() and not t.cancelled():
        t.exception()


async def apart(work: Callable[[], Coroutine[Any, Any, T]], name: str) -> T:
    """``work()`` run to its end on an event loop of its own, in a daemon thread: a long job's rows and
    arithmetic (the worker's reconciliation) no longer hold the loop that pays credits for seconds at a
    time; the two threads share the interpreter a few milliseconds at a time. ``work`` opens and closes
    its own connections (a pool belongs to the loop that made it). Cancelled, this cancels ``work`` on its
    loop and waits for its end up to ``STOP_SECONDS`` (then says so and goes on: the thread is a daemon,
    an exit never waits for it)."""
    caller = asyncio.get_running_loop()
    finished: asyncio.Future[T] = caller.create_future()
    own = asyncio.new_event_loop()
    task = own.create_task(work())  # (its loop not running yet: made here, run there)
    gone = threading.Event()  # the caller stopped waiting: the end is logged, not handed back

    def settle(result: T | None, error: BaseException | None) -> None:
        if finished.done():
            return
        if gone.is_set():  # (only that it ended: nobody takes its result)
            if error is not None and not isinstance(error, asyncio.CancelledError):
                log.error("%s, no longer awaited, failed: %r", name, error)
            finished.set_result(None)  # type: ignore[arg-type]
        elif error is None:
            finished.set_result(result)  # type: ignore[arg-type]
        else:
            finished.set_exception(error)

    def run() -> None:
        try:
            result, error = own.run_until_complete(task), None
        except BaseException as e:  # (handed to the awaiting loop as it is)
            result, error = None, e
        finally:
            own.close()
        with contextlib.suppress(RuntimeError):  # (the caller's loop closed meanwhile)
            caller.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name=name, daemon=True).start()
    try:
        return await asyncio.shield(finished)
    except asyncio.CancelledError:
        gone.set()
        with contextlib.suppress(RuntimeError):  # (its loop already closed: it has ended)
            own.call_soon_threadsafe(task.cancel)
        done, _ = await asyncio.wait([finished], timeout=STOP_SECONDS)
        if not done:
            log.error("%s: still running %g s after being cancelled; left", name, STOP_SECONDS)
        raise
