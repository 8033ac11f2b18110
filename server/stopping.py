"""Stopping background tasks, with a bound.

One cancel is not always the end of a task on Python 3.11: ``asyncio.wait_for`` returns its inner result
when a cancel arrives in the same turn as that result (``except CancelledError: if fut.done(): return
fut.result()``), and redis-py sends every command through ``wait_for`` once a socket timeout is set (ours
always are). A loop that goes round again after that ran for ever, and so did the shutdown waiting on it:
``redpacket up`` did not stop on Ctrl-C in CI, its worker's tasks still running 45 s later. The cancel is
still counted on the task (``Task.cancelling()``), so every loop of ours that runs until cancelled calls
``check_cancelled()`` each round, and every stop is bounded and names what did not stop. A child process
(``child``) is stopped the same way: asked to stop, killed after ``STOP_SECONDS``."""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import logging
import os
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from types import FrameType
from typing import Any

log = logging.getLogger(__name__)

STOP_SECONDS = 5.0  # how long a stop waits for the tasks it cancelled before saying so and going on
EXIT_SECONDS = 15.0  # how long a process on its way out may take before its stacks are shown and it ends


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


def leave_within(seconds: float = EXIT_SECONDS) -> None:
    """Bound the rest of this process's life: if it still runs ``seconds`` from now, every thread's stack
    goes to stderr and it ends, exit code 1 (faulthandler's watchdog: no interpreter lock needed)."""
    faulthandler.dump_traceback_later(seconds, exit=True)


def say_where_stuck(after: float, *, then_exit: bool) -> None:
    """Watch this process's stop: if it still runs ``after`` seconds from now, every task of the loop and
    where it waits (a second earlier), then every thread's stack, go to stderr; with ``then_exit`` the
    process ends there, exit code 1. Armed by the first SIGTERM or SIGINT, before any of the stop runs:
    a hang inside the loop's own end (``uvloop.run`` cancels what is left and waits on it without a
    bound) is caught too. The stacks and the exit come from faulthandler's watchdog, a thread of C that
    needs no interpreter lock, so they come even if the loop's thread is blocked holding it (a cancel
    that lands while uvloop spawns a child can do that: MagicStack/uvloop#118)."""
    faulthandler.dump_traceback_later(after, exit=then_exit)
    with contextlib.suppress(RuntimeError):  # (no loop running: the stacks alone)
        asyncio.get_running_loop().call_later(max(after - 1, 0), print_tasks)


def print_tasks() -> None:
    """Every task of the running loop on stderr: one line each saying where it waits, then its stack."""
    tasks = asyncio.all_tasks()
    print(f"still running while stopping: {len(tasks)} task(s), each where it waits:", file=sys.stderr)
    for task in tasks:  # one line each first: a log cut short still shows every task
        print(f"  {task.get_name()}: {waits_at(task)}", file=sys.stderr)
    for task in tasks:
        print(f"--- {task!r}", file=sys.stderr)
        task.print_stack(limit=12, file=sys.stderr)
    sys.stderr.flush()


def waits_at(task: asyncio.Task[object]) -> str:
    """The chain of coroutines ``task`` is suspended in, outermost first, through ``async with`` blocks
    of ``contextlib.asynccontextmanager`` (``Task.print_stack`` shows only the outermost frame)."""
    parts: list[str] = []
    coro: object = task.get_coro()
    frame: FrameType | None = None
    while coro is not None and len(parts) < 30:
        if getattr(coro, "cr_frame", None) is None and getattr(coro, "ag_frame", None) is None:
            # An async generator's step (``asend``) shows nothing: the generator is the context manager's.
            gen = getattr(frame.f_locals.get("self"), "gen", None) if frame is not None else None
            if gen is None or getattr(gen, "ag_frame", None) is None:
                break
            coro = gen
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None)
        assert frame is not None
        where = f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno}"
        parts.append(f"{getattr(coro, '__qualname__', '?')} {where}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None)
    if coro is not None:
        parts.append(type(coro).__name__)
    return " → ".join(parts) or repr(task)


def _retrieve(t: asyncio.Future[Any]) -> None:
    if t.done() and not t.cancelled():
        t.exception()


async def child(
    argv: Sequence[str], env: Mapping[str, str], what: str, nice: int = 0
) -> tuple[int, bytes, bytes]:
    """``argv`` run as a child process to its end: its exit code, and what it wrote on stdout and on
    stderr. Work of seconds of CPU beside a loop that must stay quick (the worker's reconciliation,
    beside the credits) runs there: on a thread of this process it shares the interpreter's lock with
    that loop, which waits up to the switch interval (5 ms) for it at every socket call. ``what``: its
    name in the log; ``nice``: its priority, lowered by that much. Cancelled, the child is asked to stop
    (SIGTERM), killed if it has not within ``STOP_SECONDS``, and waited for."""
    proc = await asyncio.create_subprocess_exec(
        *argv, env=dict(env), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    if nice:  # (set from here: no code runs in the child between fork and exec)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.setpriority(os.PRIO_PROCESS, proc.pid, nice)
    try:
        out, err = await proc.communicate()
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        ended = asyncio.ensure_future(proc.wait())
        done, _ = await asyncio.wait([ended], timeout=STOP_SECONDS)
        if not done:
            log.error("%s: still running %g s after SIGTERM; killed", what, STOP_SECONDS)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await ended
        raise
    return int(proc.returncode or 0), out, err
