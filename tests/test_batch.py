"""The batcher's pipelines on a real Redis (``server.store.batch``): each answer to its own caller, and one
bound for a whole pipeline — a pipeline whose answer never comes fails within it, and the connection it
was sent on is never used again (its late answer would be read as the next caller's)."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest
import redis
from redis.asyncio import Redis

from server.durability import Durability
from server.store.batch import Batcher, NotDurable
from server.store.redisnodes import RedisNodes
from tests.hubtools import eventually
from tests.redisproc import RedisProcess, redis_process


async def test_a_pipeline_answers_each_call_its_own_and_errors_in_place(redis_url: str) -> None:
    nodes = await RedisNodes(redis_url, 4, timeout=2.0).open()
    try:
        batcher = Batcher(nodes)
        key = "test:batch:own"
        await nodes.client.delete(key)
        # One tick's calls: one pipeline, each call answered with its own reply (or its own error).
        answers = await asyncio.gather(
            batcher.call(lambda pipe: pipe.set(key, "1"), key),
            batcher.call(lambda pipe: pipe.incr(key), key),
            batcher.call(lambda pipe: pipe.lpush(key, "x"), key),  # a string: WRONGTYPE
            batcher.call(lambda pipe: pipe.hgetall("test:batch:none"), key),
            return_exceptions=True,
        )
        assert answers[:2] == [True, 2]
        assert isinstance(answers[2], redis.ResponseError) and "WRONGTYPE" in str(answers[2])
        assert answers[3] == {}  # (redis-py's reading of each command's reply is kept)
        assert batcher.batches == 1 and batcher.calls == 4
    finally:
        await nodes.aclose()


async def test_a_pipeline_left_unanswered_fails_within_the_bound_and_its_connection_is_dropped(
    redis_url: str,
) -> None:
    """A BLPOP on an empty list: Redis never answers it, as a Redis that hangs would not. The call fails
    with redis-py's timeout within the bound (one for the pipeline: the connection carries no timer of
    its own while the batcher holds it, and gets its own back after); the list then gets an item, and
    the next calls are answered their own replies — the dropped connection's late answer is read by
    nobody."""
    nodes = await RedisNodes(redis_url, 1, timeout=0.5).open()  # (one connection: the next call reuses it)
    try:
        batcher = Batcher(nodes)
        empty = "test:batch:never"
        await nodes.client.delete(empty)
        began = time.monotonic()
        with pytest.raises(redis.TimeoutError):
            await asyncio.wait_for(batcher.call(lambda pipe: pipe.blpop([empty], 0), empty), 10)
        assert time.monotonic() - began < 5
        await nodes.client.rpush(empty, "late")  # had the BLPOP's connection lived, it would take this
        assert await batcher.call(lambda pipe: pipe.llen(empty), empty) == 1
        assert await batcher.call(lambda pipe: pipe.get("test:batch:absent"), empty) is None
        # The pool's connection has its own bound again outside the batcher: a command left unanswered
        # on it fails by itself.
        client: Redis = nodes.client
        with pytest.raises(redis.TimeoutError):
            await asyncio.wait_for(client.blpop(["test:batch:never:2"], 0), 10)
    finally:
        await nodes.client.delete("test:batch:never")
        await nodes.aclose()


async def test_a_pipeline_whose_reading_fails_midway_leaves_no_answer_for_the_next(redis_url: str) -> None:
    """Reading one answer fails (here a reply reader that raises, as a bug would) with an answer still to
    come behind it (a BLPOP that Redis answers, nil, only a second later): the whole pipeline fails, and
    its connection is dropped, so the next pipeline on the one connection the pool has reads its own
    answer. Kept, the connection would pass the pool's check for unread data (nothing has come yet) and
    the next GET would read the BLPOP's late nil as its own."""
    nodes = await RedisNodes(redis_url, 1, timeout=5.0).open()
    client: Redis = nodes.client
    key = "test:batch:midway"
    try:
        batcher = Batcher(nodes)
        await client.set(key, "its own")
        await client.delete("test:batch:midway:empty")

        def broken(response: object, **options: object) -> object:
            raise ZeroDivisionError("a reply reader's bug")

        client.set_response_callback("ECHO", broken)
        failed = await asyncio.gather(
            batcher.call(lambda pipe: pipe.echo("x"), key),
            batcher.call(lambda pipe: pipe.blpop(["test:batch:midway:empty"], 1), key),
            return_exceptions=True,
        )
        assert all(isinstance(f, ZeroDivisionError) for f in failed), failed
        assert await asyncio.wait_for(batcher.call(lambda pipe: pipe.get(key), key), 10) == b"its own"
    finally:
        await client.delete(key)
        await nodes.aclose()


async def test_a_pipeline_ending_with_two_waits_is_given_the_time_of_both(tmp_path: Path) -> None:
    """``aof+replica`` ends a durable pipeline with WAITAOF, then WAIT, and each may take the whole
    durability wait. With the replica stopped (SIGSTOP: still connected as the master sees it, never
    acknowledging), WAIT takes all of it: the pipeline outlasts one command's bound (1 s here), and is
    answered all the same — short of its durability (``NotDurable``), not a timeout — within the bound
    its waits add (1 s + 2 s)."""
    async with (
        redis_process(tmp_path / "primary", "--appendfsync", "always") as primary,
        redis_process(tmp_path / "replica", "--replicaof", "127.0.0.1", str(primary.port)) as replica,
    ):
        await eventually(lambda: _replica_online(primary), timeout=30)
        nodes = await RedisNodes(primary.url, 2, timeout=1.0).open()
        assert replica.proc is not None
        replica.proc.send_signal(signal.SIGSTOP)
        try:
            batcher = Batcher(nodes, Durability.AOF_REPLICA, timeout_ms=2000)
            began = time.monotonic()
            with pytest.raises(NotDurable):
                await asyncio.wait_for(batcher.call(lambda pipe: pipe.set("k", "v"), "k", durable=True), 20)
            assert time.monotonic() - began > 1.0  # (the state: longer than one command's bound)
        finally:
            replica.proc.send_signal(signal.SIGCONT)
            await nodes.aclose()


def _replica_online(primary: RedisProcess) -> bool:
    info = redis.Redis(port=primary.port).info("replication")
    return any(
        k.startswith("slave") and isinstance(v, dict) and v.get("state") == "online" for k, v in info.items()
    )
