"""The worker's cron jobs when a service is away: one line, not a traceback."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from worker.metrics import WorkerMetrics


async def test_a_cron_job_failing_on_a_service_away_is_one_line_not_a_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """At a master's kill every cron job that touches Redis fails once, and a database gone fails them the
    same: a warning line and the next run, not arq's traceback. Any other failure — a database's answer
    to a bad statement included — is still arq's to report."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    from server.store.db import DatabaseError, RetryableError
    from worker.main import transient_is_a_line

    async def redis_away(ctx: object) -> int:
        raise RedisConnectionError("Error 111 connecting to 127.0.0.1:7000. Connection refused.")

    async def database_away(ctx: object) -> int:
        raise RetryableError("(2003, \"Can't connect to MySQL server on '127.0.0.1'\")")

    async def a_bug(ctx: object) -> int:
        raise ValueError("a bug")

    async def a_bad_statement(ctx: object) -> int:
        raise DatabaseError("(1054, \"Unknown column 'no_such_column' in 'SELECT'\")")

    ctx: Any = {"metrics": WorkerMetrics()}
    with caplog.at_level(logging.WARNING, logger="worker"):
        for _ in range(3):  # (an outage is said once, however many runs it fails)
            assert await transient_is_a_line(redis_away)(ctx) is None
            assert await transient_is_a_line(database_away)(ctx) is None
    assert [r.getMessage() for r in caplog.records] == [
        "Redis is unavailable (Error 111 connecting to 127.0.0.1:7000. Connection refused., met by the"
        " redis_away): retrying until it is back",
        "the database is unavailable ((2003, \"Can't connect to MySQL server on '127.0.0.1'\"), met by the"
        " database_away): retrying until it is back",
    ]
    assert transient_is_a_line(redis_away).__qualname__.endswith("redis_away")  # arq names the cron so
    with pytest.raises(ValueError):
        await transient_is_a_line(a_bug)(ctx)
    with pytest.raises(DatabaseError):
        await transient_is_a_line(a_bad_statement)(ctx)
