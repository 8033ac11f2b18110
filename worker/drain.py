"""The credit drain: every worker's way of paying grabs. It reads the credit records that the grab script
writes next to each share (one outbox stream per shard, ``keys.credit_outbox``), hundreds at a time,
pays them in one transaction per batch (``credit_many``, exactly once by the database's unique keys;
a credit the ledger refuses is recorded as refused in the same transaction), and only then acknowledges
them (``lua/ack_credits.lua``: off the outbox, and each paid share out of its packet's list in Redis —
a repair that waited for the packet's lock while the credit was in flight may have put it back).

With durable grabs a worker pays only what is durable: each read (``XREADGROUP``, ``XAUTOCLAIM``) ends
with the same wait as a grab, on its connection, which covers every write before it. So a credit it pays
was never made on data Redis can still lose, and a repair of the packet after a crash always finds it
(in Redis or in the database) instead of handing its share out again.

All workers read every shard's outbox as one consumer group (``keys.CREDIT_GROUP``), each under its own
consumer name, so each record goes to one worker. What a worker has read and not acknowledged stays
*pending* under its name: it renews its hold every ``LEASE_MS / 4`` while it pays, so a worker that dies
(kill -9, a lost machine) leaves entries that fall idle, and every worker takes over entries idle longer
than ``LEASE_MS`` (``XAUTOCLAIM``, looked for every second). A worker that only stalled past its lease may
pay a batch another worker also pays: the database credits each share once, so that is wasted work only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, assert_never

from redis.asyncio.client import Pipeline
from redis.exceptions import ResponseError

from server import tracing
from server.core import Core
from server.ids import GroupId, PacketId
from server.money.crediting import credit_many
from server.money.creditrules import Outcome, Refusal
from server.money.endpoints import configured
from server.money.ledger import now_ms
from server.stopping import check_cancelled, stop
from server.store import keys
from server.store.records import CreditEntry
from server.store.scriptcalls import AckCreditsCall, run
from worker.metrics import CREDIT_OUTCOMES, WorkerMetrics

log = logging.getLogger(__name__)

LEASE_MS = 5_000
TAKEOVER_EVERY = 1.0
PAY_AT_ONCE = 500
# Entry ids a drain remembers having read (``_take_over`` tells its own from another worker's).
SEEN_AT_MOST = 100_000
# The longest a batch's trace contexts take to be kept for their webhook deliveries (``_traced``).
TRACE_KEEP_SECONDS = 1.0


@dataclass
class Batch:
    """Outbox entries read together: per shard their ids, and the credits they name (shard, id, credit)."""

    items: list[tuple[int, bytes, CreditEntry]] = field(default_factory=list)
    deleted: dict[int, list[bytes]] = field(default_factory=dict)  # pending ids whose entry is gone
    traces: dict[int, str] = field(default_factory=dict)  # item → its grab's span (``server.tracing``)
    paid_ns: tuple[int, int] = (0, 0)  # when its transaction began and committed (for its spans)

    def __len__(self) -> int:
        return len(self.items)


class CreditDrain:
    """Reads up to ``batch`` credits per shard at a time. While one batch is paid in the database the next
    one is read from Redis and the previous one acknowledged, so Redis and database work overlap."""

    def __init__(
        self,
        core: Core,
        metrics: WorkerMetrics | None = None,
        batch: int = PAY_AT_ONCE,
        lease_ms: int = LEASE_MS,
        consumer: str | None = None,
    ) -> None:
        self.core = core
        self.metrics = metrics or WorkerMetrics()
        self.batch = batch
        self.lease_ms = lease_ms
        self.consumer = consumer or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.holding: dict[int, set[bytes]] = defaultdict(set)  # shard → ids read and not yet acknowledged
        self.credited = 0  # shares newly credited
        self.processed = 0  # outbox entries acknowledged (credited, already paid, or refused)
        self._groups_made = False
        self._last_takeover = 0.0
        # Entries this worker read (the latest ``SEEN_AT_MOST``): taken back after an outage, they are its
        # own, not "left unpaid by another worker".
        self._seen: OrderedDict[tuple[int, bytes], None] = OrderedDict()

    async def run(self, idle_sleep: float = 0.05) -> None:
        """Drain until cancelled, riding out Redis and database outages (retrying with back-off).
        Cancelled mid-batch: its entries stay pending under this consumer, fall idle, and are paid by
        whoever takes them over; the database pays nothing twice."""
        failures = 0
        said = False  # a failure that is no service away was said (its end is said too)
        while True:
            check_cancelled()
            try:
                await self._drain()
                if said:
                    log.warning("credit drain working again after %d failed attempt(s)", failures)
                failures, said = 0, False
                await asyncio.sleep(idle_sleep)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                failures += 1
                self.metrics.drain_failures.inc()
                # Redis or the database away: said once for the whole worker (``worker.outages``).
                if not self.metrics.outages.failed("credit drain", e) and not said:
                    log.warning("credit drain failed (%s); retrying with back-off", e)
                    said = True
                self._groups_made = False  # Redis may have come back without them
                await asyncio.sleep(min(0.1 * 2**failures, 2.0))

    async def until_empty(self) -> int:
        """Drain until no credit is waiting (tests, benchmarks); returns how many were newly credited."""
        self._last_takeover = 0.0
        await self._drain()
        return self.credited

    async def _drain(self) -> None:
        """Read, pay and acknowledge batches until nothing is waiting."""
        await self._make_groups()
        renewing = asyncio.ensure_future(self._renew_leases())
        reading: asyncio.Future[Batch | None] = asyncio.ensure_future(self._read())
        finishing: asyncio.Future[None] | None = None
        paid = False
        try:
            while True:
                check_cancelled()
                taken = await reading
                if taken is None and paid:
                    # That read ran while the last batch was being paid: look again for what came since.
                    taken = await self._read()
                if taken is None:
                    return
                reading = asyncio.ensure_future(self._read())  # the next batch, while this one pays
                outcomes = await self._pay(taken)
                paid = True
                if finishing is not None:
                    await finishing
                finishing = asyncio.ensure_future(self._finish(taken, outcomes))
        finally:
            try:
                # The last acknowledgement, shielded from a cancel of this task, which still propagates
                # (swallowed, a stopping worker once drained for ever); its failure propagates too.
                if finishing is not None:
                    await asyncio.shield(finishing)
            finally:
                # Whatever that raised, the batch read ahead is given back and the renewer stops: left
                # running (an acknowledgement lost as Redis restarted skipped this once), it renewed the
                # read-ahead entries for ever, so no take-over ever found them idle, and grabs told "won"
                # waited unpaid until the worker restarted.
                try:
                    await stop([reading], "the credit drain's read-ahead")
                    if reading.done() and not reading.cancelled() and reading.exception() is None:
                        unpaid = reading.result()
                        if unpaid is not None:
                            with contextlib.suppress(Exception):
                                await self._release(unpaid)
                finally:  # (cancelled again meanwhile: the renewer is still cancelled, first thing)
                    await stop([renewing], "the credit drain's lease renewer")

    async def _make_groups(self) -> None:
        """The consumer group on every shard's outbox, from its first entry (idempotent)."""
        if self._groups_made:
            return
        results = await self._each_shard(
            lambda n, pipe: pipe.xgroup_create(
                keys.credit_outbox(n), keys.CREDIT_GROUP, id="0", mkstream=True
            )
        )
        for r in results:
            if isinstance(r, Exception) and "BUSYGROUP" not in str(r):
                raise r
        self._groups_made = True

    async def _each_shard(
        self,
        command: Callable[[int, Pipeline], object],
        shards: list[int] | None = None,
        durable: bool = False,
    ) -> list[Any]:
        """One command per shard's outbox, sent as one pipeline per master (``server.store.batch``); each
        answer, or the exception that answered it, in shard order. ``durable``: answered once the
        configured grab durability covers it (and every write before it)."""
        b = self.core.batcher

        def one(n: int) -> Callable[[Pipeline], object]:
            return lambda pipe: command(n, pipe)

        calls = [
            b.call(one(n), keys.credit_outbox(n), durable)
            for n in (range(keys.SHARDS) if shards is None else shards)
        ]
        return list(await asyncio.gather(*calls, return_exceptions=True))

    async def _renew_leases(self) -> None:
        while True:
            check_cancelled()
            await asyncio.sleep(self.lease_ms / 4000)
            held: dict[int, list[Any]] = {n: sorted(ids) for n, ids in self.holding.items() if ids}
            if held:
                # A lapsed lease only costs a second payment attempt: failures here are not worth more.
                await self._each_shard(
                    # (a default argument binds held per shard; mypy cannot type a lambda's defaults.)
                    lambda n, pipe, held=held: pipe.xclaim(  # type: ignore[misc]
                        keys.credit_outbox(n), keys.CREDIT_GROUP, self.consumer, 0, held[n], justid=True
                    ),
                    list(held),
                )

    async def _read(self) -> Batch | None:
        """Entries other workers left idle past their lease (looked for once a second), then new ones."""
        batch = Batch()
        if time.monotonic() - self._last_takeover >= TAKEOVER_EVERY:
            self._last_takeover = time.monotonic()
            await self._take_over(batch)
        results = await self._each_shard(
            lambda n, pipe: pipe.xreadgroup(
                keys.CREDIT_GROUP, self.consumer, {keys.credit_outbox(n): ">"}, count=self.batch
            ),
            durable=True,
        )
        failed: Exception | None = None
        for n, result in enumerate(results):
            if isinstance(result, ResponseError) and "NOGROUP" in str(result):
                self._groups_made = False  # Redis lost it (a restart): made again on the next drain
                continue
            if isinstance(result, Exception):
                failed = failed or result
                continue
            for _, entries in result or []:
                self._add(batch, n, entries)
        if failed is not None:
            # One master failed (away, or its wait for durability fell short): what the others gave is
            # given back at once, not held (and renewed) by a batch that will not be paid.
            with contextlib.suppress(Exception):
                await self._release(batch)
            raise failed
        return batch if batch.items or batch.deleted else None

    async def _take_over(self, batch: Batch) -> None:
        results = await self._each_shard(
            lambda n, pipe: pipe.xautoclaim(
                keys.credit_outbox(n),
                keys.CREDIT_GROUP,
                self.consumer,
                self.lease_ms,
                "0-0",
                count=self.batch,
            ),
            durable=True,
        )
        taken = others = 0
        for n, result in enumerate(results):
            if isinstance(result, Exception):
                continue  # NOGROUP after a restart: the group is made again; nothing was pending there
            entries = result[1] if len(result) > 1 else []
            deleted = result[2] if len(result) > 2 else []
            taken += len(entries)
            others += sum(1 for entry_id, _ in entries if (n, entry_id) not in self._seen)
            self._add(batch, n, entries)
            if deleted:
                batch.deleted.setdefault(n, []).extend(deleted)
        if taken:
            self.metrics.takeovers.inc(taken)
        if others:
            log.warning("took over %d credit(s) another worker left unpaid", others)

    def _add(self, batch: Batch, n: int, entries: list[Any]) -> None:
        for entry_id, fields in entries:
            if not fields:
                batch.deleted.setdefault(n, []).append(entry_id)
                continue
            batch.items.append((n, entry_id, CreditEntry.parse(fields[b"c"])))
            if len(fields) > 1 and b"t" in fields:  # the grab was traced: its span, for the credit's
                batch.traces[len(batch.items) - 1] = fields[b"t"].decode()
            self.holding[n].add(entry_id)
            self._seen[(n, entry_id)] = None
            if len(self._seen) > SEEN_AT_MOST:
                self._seen.popitem(last=False)

    async def _pay(self, taken: Batch) -> list[Outcome]:
        credits = [c for _, _, c in taken.items]
        taken.paid_ns = (time.time_ns(), 0)
        try:
            outcomes: list[Outcome] = []
            for i in range(0, len(credits), PAY_AT_ONCE):
                outcomes += await credit_many(self.core.db, credits[i : i + PAY_AT_ONCE], partial=True)
            taken.paid_ns = (taken.paid_ns[0], time.time_ns())
            return outcomes
        except BaseException:
            # Nothing more was committed: let these go to whoever takes them next, at once.
            with contextlib.suppress(Exception):
                await self._release(taken)
            raise

    async def _traced(self, taken: Batch, outcomes: list[Outcome]) -> None:
        """Each traced grab's credit, a span of its trace, and the batch's ledger transaction its child
        (one transaction, a span in each trace it paid); kept for the webhook delivery of its event. Run
        once the batch is acknowledged; whatever fails here is said at debug level and changes nothing."""
        start_ns, end_ns = taken.paid_ns
        db = {"db.system": self.core.db.dialect.name, "batch": len(taken.items)}
        kept: dict[str, str] = {}
        for i, parent in taken.traces.items():
            c = taken.items[i][2]
            attributes = {"packet_id": c.packet_id, "user_id": c.user_id, "seq": c.seq, "amount": c.amount}
            outcome = str(outcomes[i])
            credit = tracing.recorded(
                "credit", parent, start_ns, end_ns, "consumer", outcome=outcome, **attributes
            )
            tracing.recorded("ledger credit transaction", credit, start_ns, end_ns, "client", **db)
            kept[keys.trace_of("grab", c.packet_id, c.seq)] = credit
        if configured(self.core.settings):  # (webhooks: their deliveries join the credit's trace)
            await tracing.keep_many(self.core.redis, kept, TRACE_KEEP_SECONDS)

    async def _release(self, taken: Batch) -> None:
        """Give entries back: marked long idle, so the next takeover (by any worker) pays them. Whether
        or not Redis takes the mark, this worker stops renewing them: unmarked, they fall idle after a
        lease and are taken over then."""
        per_shard: dict[int, list[Any]] = defaultdict(list)
        for n, entry_id, _ in taken.items:
            per_shard[n].append(entry_id)
        try:
            answers = await self._each_shard(
                lambda n, pipe: pipe.xclaim(
                    keys.credit_outbox(n),
                    keys.CREDIT_GROUP,
                    self.consumer,
                    0,
                    per_shard[n],
                    idle=10 * self.lease_ms,
                    justid=True,
                ),
                list(per_shard),
            )
        finally:
            for n, ids in per_shard.items():
                self.holding[n].difference_update(ids)
        for answer in answers:
            if isinstance(answer, Exception):
                raise answer

    async def _finish(self, taken: Batch, outcomes: list[Outcome]) -> None:
        finished = now_ms()
        self.metrics.batch_size.observe(len(taken.items))
        acks: dict[int, list[bytes]] = {n: list(ids) for n, ids in taken.deleted.items()}
        # Per shard, per packet (group, packet): the paid credits, for Redis to agree with the ledger.
        paid: dict[int, dict[tuple[GroupId, PacketId], list[CreditEntry]]] = defaultdict(
            lambda: defaultdict(list)
        )
        # Counted per batch, not per credit: a labelled counter's labels() and inc() cost 1.5 us a call.
        counts = dict.fromkeys(CREDIT_OUTCOMES, 0)
        lag = self.metrics.credit_lag
        later = Batch()  # a sharded ledger's credits whose shard was away: given back, paid later
        try:
            for (n, entry_id, c), outcome in zip(taken.items, outcomes, strict=True):
                # Every outcome by name (mypy holds the match to the closed type): an entry is acknowledged
                # only once the ledger has paid it or recorded why it never will.
                match outcome:
                    case "later":
                        later.items.append((n, entry_id, c))
                        continue
                    case "credited":
                        counts["credited"] += 1
                        lag.observe(max(0, finished - c.grabbed_ms) / 1000)
                        paid[n][(c.group_id, c.packet_id)].append(c)
                    case "already":
                        counts["already"] += 1
                        paid[n][(c.group_id, c.packet_id)].append(c)
                    case Refusal():
                        # Recorded in credit_refusals by the transaction that refused it (reconciliation
                        # reports it); retrying cannot fix it. Never pay on a guess.
                        counts["refused"] += 1
                        log.error("credit of packet %d share %d refused: %s", c.packet_id, c.seq, outcome)
                    case _:
                        assert_never(outcome)
                acks.setdefault(n, []).append(entry_id)
        except BaseException:
            # An outcome this drain does not know: nothing acknowledged, and the batch given back at once
            # (not renewed here), for a worker that knows better.
            with contextlib.suppress(Exception):
                await self._release(taken)
            raise
        self.credited += counts["credited"]
        for counted, k in counts.items():
            if k:
                self.metrics.credits.labels(counted).inc(k)
        calls = [
            run(self.core.batcher, self.core.scripts, AckCreditsCall(n, ids, dict(paid.get(n, {}))))
            for n, ids in acks.items()
        ]
        try:
            await asyncio.gather(*calls)  # one pipeline per master
        finally:
            # Acknowledged, or not (Redis away): either way no longer renewed here. Unacknowledged, they
            # fall idle and are taken over; the database pays nothing twice.
            for n, ids in acks.items():
                self.holding[n].difference_update(ids)
        if later:
            log.warning("%d credit(s) wait for their shard of the ledger: given back", len(later))
            await self._release(later)
        self.processed += len(taken.items) - len(later)
        if taken.traces and tracing.ON:
            try:
                await self._traced(taken, outcomes)
            except Exception as e:  # (bookkeeping of traces never touches the money)
                log.debug("credit spans not recorded: %s", e)
