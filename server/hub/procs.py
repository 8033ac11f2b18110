"""``redpacket serve --workers N``: N hub processes on one listening socket.

Python runs one core per process; a hub is one process. All of a hub's state that matters is in Redis
and the database, so N hubs on one machine are N independent hubs (each with its own pub/sub connection,
presence and announcements) that happen to share a port: the kernel hands each new connection to one of
them. The supervisor (this module) binds the socket, forks the workers, restarts one that dies, and on
SIGTERM / SIGINT passes the signal on and waits while each drains (``REDPACKET_SHUTDOWN_SECONDS``);
SIGUSR1 is passed on (each process's database goes back to the first node of its URL it can use).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable

log = logging.getLogger(__name__)

# A worker that dies this soon after it started is failing at start: wait before starting it again.
FAILING_START_SECONDS = 5.0


def _exit_now(signum: int, frame: object) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def supervise(n: int, run_one: Callable[[int], None], poll_seconds: float = 0.2) -> int:
    """Run ``run_one(slot)`` in ``n`` forked processes (slots 0 to n - 1) until a signal says stop; the
    exit code."""
    children: dict[int, tuple[int, float]] = {}  # pid → (slot, started at)
    stopping = False

    def start(slot: int) -> None:
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                # Until uvicorn takes SIGTERM over (to drain), and again once it has drained and raises it
                # once more: end the process at once. Not by raising SystemExit — a signal handled while a
                # weakref callback runs (the import system's, during start-up) has its exception printed
                # and dropped, and the process went on to serve after its supervisor had said stop.
                signal.signal(signal.SIGTERM, _exit_now)
                signal.signal(signal.SIGINT, signal.default_int_handler)
                signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # until the hub takes it (its database writer)
                run_one(slot)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 0
            except KeyboardInterrupt:
                code = 0
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)
        children[pid] = (slot, time.monotonic())

    def stop(signum: int, _: object) -> None:
        nonlocal stopping
        stopping = True
        for pid in children:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def told(signum: int, _: object) -> None:
        for pid in children:  # each hub process goes back to the first database node it can use
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass

    for slot in range(n):
        start(slot)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGUSR1, told)
    failed = 0
    while children:
        time.sleep(poll_seconds)
        for pid, (slot, started) in list(children.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if not done:
                continue
            del children[pid]
            code = os.waitstatus_to_exitcode(status)
            if stopping:
                continue
            log.error("hub worker %d (pid %d) exited with %d; starting another", slot, pid, code)
            if time.monotonic() - started < FAILING_START_SECONDS:
                failed += 1
                time.sleep(min(30.0, FAILING_START_SECONDS * failed))
            else:
                failed = 0
            if not stopping:
                start(slot)
    return 0
