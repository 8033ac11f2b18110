"""``engines.when_ready``: a process's first steps on its database wait while a cluster settles (a node
not ready, a transaction to run again) and only then; a database that is down or misnamed is reported at
once. (A real worker started on a Galera cluster out of its primary component: ``test_galera.py``.)"""

from __future__ import annotations

import pytest

from server.store.db import (
    CommitUnknown,
    DatabaseError,
    IntegrityError,
    NotReady,
    RetryableError,
    Unreachable,
)
from server.store.engines import settling, when_ready


@pytest.mark.parametrize(
    ("error", "waited_for"),
    [
        (NotReady("the Galera node 127.0.0.1:3306 is not synced in the primary component"), True),
        (RetryableError("Lock wait timeout exceeded", reason="lock_wait"), True),
        (RetryableError("the database node failed; moved to the next", reason="failover"), True),
        (CommitUnknown("lost"), True),
        (Unreachable("Can't connect to MySQL server"), False),
        (DatabaseError("Unknown database 'ledgr'"), False),
        (IntegrityError("Duplicate entry"), False),
    ],
)
def test_only_a_not_now_is_waited_for(error: DatabaseError, waited_for: bool) -> None:
    assert settling(error) is waited_for


async def test_a_settling_database_is_tried_again_until_it_answers() -> None:
    failures = [NotReady("not synced"), RetryableError("lock wait", reason="lock_wait")]
    calls = 0

    async def attempt() -> str:
        nonlocal calls
        calls += 1
        if failures:
            raise failures.pop(0)
        return "ready"

    assert await when_ready(attempt, within=30) == "ready"
    assert calls == 3


@pytest.mark.parametrize("error", [Unreachable("refused"), DatabaseError("Access denied for user")])
async def test_a_database_down_or_misnamed_is_raised_at_once(error: DatabaseError) -> None:
    calls = 0

    async def attempt() -> None:
        nonlocal calls
        calls += 1
        raise error

    with pytest.raises(type(error)) as raised:
        await when_ready(attempt, within=30)
    assert raised.value is error and calls == 1


async def test_a_cluster_that_never_settles_is_an_error_that_says_so() -> None:
    calls = 0

    async def attempt() -> None:
        nonlocal calls
        calls += 1
        raise NotReady("the Galera node 127.0.0.1:3306 is not synced in the primary component")

    with pytest.raises(DatabaseError, match=r"not ready within 0\.2 s: the Galera node") as raised:
        await when_ready(attempt, within=0.2)
    assert not isinstance(raised.value, NotReady)  # (so the start-up check reports it, and exits)
    assert calls >= 2
