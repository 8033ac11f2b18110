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


def test_a_failed_jobs_result_is_kept_as_its_error_text_without_a_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """arq keeps a failed job's exception as its result. msgpack cannot hold an exception, so arq used to log
    "error serializing result" with a traceback (seen at a worker stopped during its reconciliation) before
    keeping a placeholder; the queue's serializer keeps the error's text instead. Other objects are still
    refused: the queue carries no Python object by accident."""
    from arq.jobs import serialize_result

    from server.store.queue import job_deserializer, job_serializer

    caplog.set_level(logging.WARNING)
    failure = RuntimeError("`redpacket reconcile` exited -15 with no report")
    raw = serialize_result(
        "reconcile_job", (), {}, 1, 0, False, failure, 0, 1, "ref", "arq:queue", "id",
        serializer=job_serializer,
    )  # fmt: skip
    assert raw is not None and not caplog.records
    kept = job_deserializer(raw)
    assert kept["r"] == repr(failure) and kept["s"] is False
    with pytest.raises(TypeError, match="does not carry"):
        job_serializer({"r": object()})
