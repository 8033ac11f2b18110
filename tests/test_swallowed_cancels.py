"""The worker's loops end on a cancel that one of their calls swallowed (``server.stopping``): `redpacket
up` did not stop on Ctrl-C in CI, its worker's tasks still running 45 s on. On Python 3.11 every Redis
command can swallow a cancel (redis-py sends through ``asyncio.wait_for``); here the call a loop makes
each round is replaced by one that does exactly what ``wait_for`` does then — takes the cancel and
returns its answer — so that each test first sees the cancel swallowed, then the loop end anyway."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

import worker.main as worker_main
from server.core import Core
from worker.drain import CreditDrain
from worker.metrics import WorkerMetrics
from worker.webhooks import Dispatcher


class Swallower:
    """One awaited call: the first waits until its task is cancelled and returns ``answer`` all the same
    (3.11's ``wait_for`` when the answer comes in the cancel's turn); later ones answer at once."""

    def __init__(self, answer: object = None) -> None:
        self.answer = answer
        self.entered = asyncio.Event()
        self.swallowed = 0
        self.calls = 0

    async def __call__(self, *args: object, **kwargs: object) -> object:
        self.calls += 1
        if self.calls == 1:
            self.entered.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.swallowed += 1
        return self.answer


def _heartbeat(core: Core, monkeypatch: pytest.MonkeyPatch, call: Swallower) -> Coroutine[Any, Any, None]:
    monkeypatch.setattr(worker_main, "_every_master", call)  # the Redis half of each beat
    return worker_main.heartbeat(core, WorkerMetrics())


def _drain(core: Core, monkeypatch: pytest.MonkeyPatch, call: Swallower) -> Coroutine[Any, Any, None]:
    drain = CreditDrain(core, WorkerMetrics())
    monkeypatch.setattr(drain, "_drain", call)  # one pass over the outbox
    return drain.run(idle_sleep=0.01)


def _renewer(core: Core, monkeypatch: pytest.MonkeyPatch, call: Swallower) -> Coroutine[Any, Any, None]:
    drain = CreditDrain(core, WorkerMetrics(), lease_ms=40)
    drain.holding[0].add(b"1-0")  # one entry held: renewed each round
    monkeypatch.setattr(drain, "_each_shard", call)
    return drain._renew_leases()


def _webhooks(core: Core, monkeypatch: pytest.MonkeyPatch, call: Swallower) -> Coroutine[Any, Any, None]:
    dispatcher = Dispatcher(core, WorkerMetrics())
    dispatcher.endpoints = {"e": dispatcher.endpoints.get("e")}  # type: ignore[dict-item]
    call.answer = True  # busy: the next round at once
    monkeypatch.setattr(dispatcher, "deliver_round", call)
    return dispatcher.deliver_to("e")


LOOPS: dict[str, Callable[[Core, pytest.MonkeyPatch, Swallower], Coroutine[Any, Any, None]]] = {
    "heartbeat": _heartbeat,
    "credit drain": _drain,
    "lease renewer": _renewer,
    "webhook deliveries": _webhooks,
}


@pytest.mark.parametrize("core", ["sqlite"], indirect=True)
@pytest.mark.parametrize("loop", list(LOOPS))
async def test_a_loop_ends_on_a_cancel_its_call_swallowed(
    core: Core, monkeypatch: pytest.MonkeyPatch, loop: str
) -> None:
    call = Swallower()
    task = asyncio.create_task(LOOPS[loop](core, monkeypatch, call))
    await asyncio.wait_for(call.entered.wait(), 30)
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=10)
    assert call.swallowed == 1  # the cancel was taken by the call, which answered: the dangerous state
    if not done:  # (stopped for good before failing: not left running into the next test)
        task.cancel()
        await asyncio.wait([task], timeout=10)
    assert task in done and task.cancelled(), f"{loop} went round again after a swallowed cancel"
