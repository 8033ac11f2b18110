"""Coalesce the Redis calls that concurrent requests make in one event-loop tick into one pipeline per
master, and make the grabs among them durable with one wait per pipeline (group commit).

One Python process awaiting one EVALSHA per request tops out near 20k/s; the same calls sent as one
pipeline per tick go several times faster, with the same per-call answers. Each call still gets its own
result or its own exception. On a Redis Cluster the calls of a tick are grouped by the master that owns
their slot.

**Durability** (``REDPACKET_GRAB_DURABILITY``): a pipeline that carries a durable call (a grab) ends with
waits on the same connection as the writes (``_waits``): ``WAITAOF 1 0`` (``aof``: the master has
fsynced its append-only file up to these writes), ``WAIT 1`` (``replica``: a replica has them), or both
(``aof+replica`` — ``WAITAOF 1 0`` alone while no replica could take the master's place, as the last
look at it said: fsynced alone until one is back; ``RedisNodes.look``). If the wait falls
short within the timeout, every durable call of the pipeline fails with ``NotDurable``
(``redis_unavailable``): the share stays taken, and the grabber's retry answers it again, waiting once
more.

Cancelling a waiting caller does not unsend its command: a grab already in the pipeline still happens in
Redis (the Lua script is atomic either way), exactly as with an unbatched call cancelled mid-flight.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from server import errors
from server.durability import Durability
from server.errors import Unavailable
from server.store.redisconn import Packed, ServerChanged
from server.store.redisnodes import Evicting, RedisNodes, moved

log = logging.getLogger(__name__)

Queue = Callable[[Pipeline], object]


class NotDurable(Unavailable):
    """The writes were made but not confirmed durable in time: retry (a grab answers the same share)."""


# Whether a call's answer needs the durability wait: True for every answer, or a test of the answer (a
# grab that only read, say a cold member cache, needs none).
Durable = bool | Callable[[object], bool]


@dataclass
class _Call:
    queue: Queue
    future: asyncio.Future[Any]
    durable: Durable
    script: AsyncScript | None = None  # the script an EVALSHA call runs (loaded again after NOSCRIPT)
    hops: int = 0  # times it was sent again after a MOVED or NOSCRIPT answer
    guarded: bool = False  # a grab: never sent to a master that may drop keys

    def needs_wait(self, answer: Any) -> bool:
        return self.durable(answer) if callable(self.durable) else self.durable


class Batcher:
    """Send every call queued during one loop tick as one non-transactional pipeline per master."""

    def __init__(
        self,
        nodes: RedisNodes,
        durability: Durability = Durability.NONE,
        timeout_ms: int = 1000,
        max_batch: int = 512,
    ) -> None:
        self._nodes = nodes
        self.durability = durability
        self._timeout_ms = timeout_ms
        self._max_batch = max_batch
        self._pending: dict[Redis, list[_Call]] = {}
        self._count = 0
        self._scheduled = False
        self._inflight: set[asyncio.Task[None]] = set()
        self._looks: dict[Redis, asyncio.Future[None]] = {}  # a read of a server's data id in flight
        self.batches = 0
        self.calls = 0

    @property
    def _counts(self) -> bool:
        """Whether its waits depend on the replicas the last look counted."""
        return self.durability.degrades

    async def call(
        self,
        queue: Queue,
        key: str,
        durable: Durable = False,
        script: AsyncScript | None = None,
        guarded: bool = False,
    ) -> Any:
        """Queue one command (``queue(pipe)`` adds it to a pipeline) for the master that owns ``key``, and
        wait for its own result. ``durable``: not answered until the configured durability is reached
        (or only the answers it accepts, if it is a test of the answer). ``guarded``: a grab, which fails
        with ``Evicting`` rather than go to a master whose eviction policy may drop keys (the share it
        takes and its credit could vanish); what pays money out (the worker's reads) goes on."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._queue(self._nodes.node_client(key), _Call(queue, fut, durable, script, guarded=guarded))
        return await fut

    def _queue(self, node: Redis, call: _Call) -> None:
        self._pending.setdefault(node, []).append(call)
        self._count += 1
        if self._count >= self._max_batch:
            self._flush()
        elif not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    async def script(
        self,
        script: AsyncScript,
        keys: list[str],
        args: list[Any],
        durable: Durable = False,
        guarded: bool = False,
    ) -> Any:
        """EVALSHA ``script`` in the next batch (``durable``, ``guarded``: as ``call``). After a SCRIPT FLUSH,
        a restart or a failover the first answer is NOSCRIPT (the script did not run): it is loaded on
        that server and sent again."""
        sha = script.sha
        return await self.call(
            lambda pipe: pipe.evalsha(sha, len(keys), *keys, *args), keys[0], durable, script, guarded
        )

    def _flush(self) -> None:
        self._scheduled = False
        pending, self._pending, self._count = self._pending, {}, 0
        loop = asyncio.get_running_loop()
        for node, batch in pending.items():
            task = loop.create_task(self._send(node, batch))
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)

    async def _send(self, node: Redis, batch: list[_Call]) -> None:
        try:
            await self._send_batch(node, batch)
        except BaseException as e:  # a bug (or a cancellation): no caller is left waiting for ever
            for c in batch:
                if not c.future.done():
                    if isinstance(e, Exception):
                        c.future.set_exception(e)
                    else:
                        c.future.cancel()
            if not isinstance(e, Exception):
                raise
            log.exception("a batch of Redis calls failed")

    async def _send_batch(self, node: Redis, batch: list[_Call]) -> None:
        self.batches += 1
        self.calls += len(batch)
        # Before a pipeline with a grab in it (a durable call, or a test that may make it one) is sent to
        # a server not looked at in the last LOOK_FIRST_AFTER, its data id is read: data replaced since
        # (a node demoted and promoted again, its connections kept) fails the batch unsent, and grab()
        # checks the packet against the database first. A restart is seen the same way, by the new
        # connection; a replica's or a moved slot's answer makes the next pipeline look first.
        watch = any(c.durable for c in batch)
        wait = self.durability.waits and watch
        look = self._nodes.look_first(node) or (self._counts and self._nodes.replicas(node) is None)
        if watch and look and not await self._looked(node, batch):
            return
        policy = self._nodes.evicting(node) if any(c.guarded for c in batch) else None
        if policy is not None:  # (read at its last look, its connections' first INFO, a usage read)
            failure = Evicting(
                f"a Redis master may drop keys (maxmemory-policy {policy}): no grab goes to it"
            )
            for c in batch:
                if c.guarded and not c.future.done():
                    c.future.set_exception(failure)
            self._nodes.look_again(node)  # (its policy is read again before the next grab)
            batch = [c for c in batch if not c.guarded]
            if not batch:
                return
        # The pipeline object only stages the commands (their arguments and how each answer is read);
        # ``_exchange`` sends them.
        pipe = node.pipeline(transaction=False)
        for c in batch:
            c.queue(pipe)
        waits = _waits(self.durability, self._nodes.replicas(node)) if wait else []
        for command in waits:
            pipe.execute_command(*command, self._timeout_ms)
        try:
            # One bound for it all: a command's, plus the durability waits it ends with (each may take the
            # whole wait: aof+replica's WAITAOF, then WAIT).
            bound = self._nodes.timeout + max(0, len(waits) - 1) * self._timeout_ms / 1000
            results = await self._exchange(node, pipe.command_stack, bound)
        except Exception as e:
            for c in batch:
                if not c.future.done():
                    c.future.set_exception(e)
            if moved(e) or isinstance(e, ConnectionError | TimeoutError | RedisConnectionError):
                await self._refresh()  # a master may have died: who owns its slots now?
            return
        short = None
        if wait:
            answers = results[len(results) - len(waits) :]
            del results[len(results) - len(waits) :]
            short = next((s for c, a in zip(waits, answers, strict=True) if (s := _shortfall(c, a))), None)
            if short is not None and self._counts:
                self._nodes.look_again(node)  # its replicas may have changed: the next batch counts again
        if any(isinstance(r, RedisError) and moved(r) for r in results):
            await self._refresh()
        if any(isinstance(r, RedisError) and (moved(r) or str(r).startswith("READONLY")) for r in results):
            self._nodes.look_again(node)  # its role changed: what it holds may be replaced before long
        for c, result in zip(batch, results, strict=True):
            if c.future.done():
                continue
            target = _moved_to(result)
            if target is not None and c.hops < MAX_HOPS:
                # A failover or a slot migration: the command did not run here. Send it where the
                # answer says the slot lives now (the slot map may not know yet).
                c.hops += 1
                self._queue(self._nodes.at(target), c)
            elif isinstance(result, NoScriptError) and c.script is not None and c.hops < MAX_HOPS:
                c.hops += 1
                try:
                    await node.script_load(c.script.script)
                except RedisError as e:
                    c.future.set_exception(e)
                else:
                    self._queue(node, c)
            elif isinstance(result, Exception):
                c.future.set_exception(result)
            elif short is not None and c.needs_wait(result):
                c.future.set_exception(NotDurable(errors.REDIS_UNAVAILABLE, short))
            else:
                c.future.set_result(result)

    async def _exchange(
        self, node: Redis, stack: Sequence[tuple[tuple[Any, ...], Mapping[str, Any]]], bound: float
    ) -> list[Any]:
        """Send a pipeline's commands on one connection of ``node``'s pool and read every answer (an error
        answer in its place, as ``Pipeline.execute(raise_on_error=False)`` gives it), all within ``bound``
        seconds: ``RedisNodes.timeout`` — each reply's bound before — and the durability waits past the
        first. One timer a pipeline, not one a reply: redis-py arms a timer for each reply it reads with a
        socket timeout set, about 4.5 µs of the hub's CPU a call (docs/benchmarks.md, issue 46), so the
        connection goes without one while it is ours. A pipeline not read to its end (a timeout, a
        cancel, a reply that could not be read) leaves its connection closed."""
        pool = node.connection_pool
        conn = await pool.get_connection()
        own = conn.socket_timeout
        conn.socket_timeout = None
        try:
            async with asyncio.timeout(bound):
                await conn.send_packed_command(conn.pack_commands([args for args, _ in stack]))
                results: list[Any] = []
                for args, options in stack:
                    try:
                        results.append(await node.parse_response(conn, args[0], **options))
                    except ResponseError as e:
                        results.append(e)
                return results
        except BaseException as e:
            # Its answers not all read (a late one would be the next caller's): never used again.
            await conn.disconnect(nowait=True)
            if isinstance(e, TimeoutError):  # (asyncio's: the bound above) as redis-py says a reply's
                where = conn.where() if isinstance(conn, Packed) else "Redis"
                raise RedisTimeoutError(f"Timeout: {where} did not answer within {bound:g} s") from e
            raise
        finally:
            conn.socket_timeout = own
            await pool.release(conn)

    async def _looked(self, node: Redis, batch: list[_Call]) -> bool:
        """Read the server's data id before sending ``batch`` to it; False (and every call failed, with
        ``ServerChanged`` if it changed) when the batch must not be sent now."""
        generation = self._nodes.generation
        look = self._looks.get(node)
        if look is None:  # one look at a time per server: the batches sent meanwhile wait for it
            look = self._looks[node] = asyncio.ensure_future(self._nodes.look(node, replicas=self._counts))
            look.add_done_callback(lambda _: self._looks.pop(node, None))
        try:
            await asyncio.shield(look)
        except Exception as e:
            failure: Exception = e
        else:
            if self._nodes.generation == generation:
                return True
            failure = ServerChanged("Redis's data was replaced: checked, then sent again")
        for c in batch:
            if not c.future.done():
                c.future.set_exception(failure)
        if isinstance(failure, ConnectionError | TimeoutError | RedisConnectionError):
            await self._refresh()
        return False

    async def _refresh(self) -> None:
        try:
            await self._nodes.refresh()
        except Exception as e:  # (not only RedisError: the cluster client raises its own for "no node")
            log.debug("the slot map could not be read again (the next call's error says it): %s", e)

    async def drain(self) -> None:
        """Wait for every batch already sent."""
        self._flush()
        if self._inflight:
            await asyncio.gather(*self._inflight, return_exceptions=True)


MAX_HOPS = 2

# A wait that ends a durable pipeline: the command and its arguments before the timeout.
Wait = tuple[str | int, ...]


async def durability_problem(client: Redis, level: str, replica: bool = False) -> str | None:
    """Why grabs cannot be made ``level``-durable (a ``Durability``, or its text) on this master as it is
    configured (with ``replica``: on this replica once promoted), or None if they can (``none`` always
    can). Start-up refuses a problem (``redpacket serve``, ``worker``); the grab bench skips the level."""
    durability = Durability(level)
    if durability.fsyncs:
        if not replica:  # (a replica refuses WAITAOF)
            try:
                # (redis-py's execute_command is not annotated.)
                await client.execute_command("WAITAOF", 1, 0, 100)  # type: ignore[no-untyped-call]
            except RedisError as e:
                return f"WAITAOF fails ({e}): it needs Redis 7.2 or later, or Valkey, with appendonly yes"
        config: dict[str, str] = {}
        try:
            for name in ("appendonly", "appendfsync"):
                value = (await client.config_get(name)).get(name)
                if value is not None:
                    config[name] = value.decode() if isinstance(value, bytes) else str(value)
        except RedisError:
            pass  # CONFIG renamed or refused (a managed server): WAITAOF's answer is all there is
        if replica and config.get("appendonly", "yes") != "yes":
            return "appendonly is no: promoted, it could not fsync grabs"
        problem = fsync_problem(durability, config.get("appendfsync", ""))
        if problem is not None:
            return problem
    elif durability is Durability.REPLICA and not replica:
        # (aof+replica goes on without one: on disk alone meanwhile)
        info = await client.info("replication")
        if int(info.get("connected_slaves", 0)) < 1:
            return "it has no replica"
    return None


def fsync_problem(level: Durability, appendfsync: str) -> str | None:
    """Why a server with this ``appendfsync`` cannot keep ``level``-durable grabs ("": not known, as when
    CONFIG is refused — WAITAOF's answer is all there is then), or None."""
    if level.fsyncs and appendfsync not in ("always", ""):
        # Measured on Valkey 9.1 (an fsync recorder under the server): with everysec, WAITAOF 1 0
        # answers at once while nothing was fsynced (the bug of redis/redis#13793), so a grab
        # answered "won" could be lost by a crash after all.
        return (
            f"appendfsync is {appendfsync}: WAITAOF then answers before the AOF is fsynced, so only"
            " appendfsync always makes a grab answered won survive a crash"
        )
    return None


def _moved_to(answer: object) -> str | None:
    """``host:port`` from a ``MOVED <slot> <host:port>`` error answer, else None."""
    if not isinstance(answer, RedisError):
        return None
    parts = str(answer).split()
    return parts[2] if len(parts) == 3 and parts[0] == "MOVED" else None


def _waits(durability: Durability, replicas: int | None) -> list[Wait]:
    """The waits that end a pipeline with a grab in it (each takes the timeout last). ``aof+replica``
    waits for the master's fsync and, unless the last look counted no replica that could take its place
    (``replicas_to_wait_for``; None: not counted), for a replica to have received the writes too
    (``WAIT``, not ``WAITAOF 1 1``: a replica that has just synced acknowledges its own fsyncs only once
    its AOF rewrite is done — measured: waits of the full timeout)."""
    if durability is Durability.AOF:
        return [("WAITAOF", 1, 0)]
    if durability is Durability.REPLICA:
        return [("WAIT", 1)]
    if durability.degrades:
        return [("WAITAOF", 1, 0)] if replicas == 0 else [("WAITAOF", 1, 0), ("WAIT", 1)]
    return []


def _shortfall(wait: Wait, answer: object) -> str | None:
    """Why the answer to ``wait`` falls short, or None if it does not."""
    if isinstance(answer, Exception):
        return f"the grab could not be made durable ({wait[0]}): {answer}"
    if wait[0] == "WAITAOF":
        local = int(answer[0]) if isinstance(answer, list | tuple) and answer else 0
        if local < 1:
            return "the grab is not yet on disk: retry"
    # (a WAIT/WAITAOF answer: an int or a list of ints, redis-py types it as its ResponseT.)
    elif int(answer) < 1:  # type: ignore[call-overload]
        return "no replica has the grab yet: retry"
    return None
