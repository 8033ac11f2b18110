"""The event outbox: what happened to the money, for the chat backend (webhooks and ``GET
/api/service/events``).

An event is written by ``record`` in the very transaction of the change it reports, so it exists exactly
when the change does: a rolled-back send leaves no ``packet.sent``, and a committed credit always has its
``share.credited``. A money event's key is its journal row's idempotency key (and its ``amount`` the
row's), so reconciliation matches the two one for one.

An event's public id is ``seq``, given by ``sequence`` after commit, in the order events are found
committed. Auto-increment ids are not that: a transaction that took id 10 may commit after one that took
id 11, and a reader who had paged past 11 would never see 10. A seq is only given to committed rows, one
batch at a time under a lock, so every later seq is larger than every earlier one: paging ``after`` a seq
never skips an event. Per user, the events of balance changes get their seqs in the order the changes
committed (a change locks the user's account row, and its event is written after the lock).
"""

from __future__ import annotations

import asyncio
import json
import weakref
from typing import Any, Literal, TypedDict

from server.store.db import Database, Tx, as_text
from server.store.records import CreditEntry
from server.store.shards import shard_of

EventType = Literal[
    "packet.sent",
    "share.credited",
    "packet.finished",
    "packet.refunded",
    "account.topup",
    "account.withdrawn",
    "hold.created",
    "hold.confirmed",
    "hold.released",
    "hold.expired",
]
TYPES: tuple[EventType, ...] = EventType.__args__  # type: ignore[attr-defined]
# The most events one sequencing transaction numbers, and one page of the events API holds.
SEQUENCE_BATCH = 1000
MAX_PAGE = 500


class Event(TypedDict):
    """An event as the backend receives it (a webhook's body, an item of the events API)."""

    id: int
    type: str
    created_ms: int
    user_id: int
    data: dict[str, Any]


class Record(TypedDict):
    """An event to write: what ``record_many`` takes."""

    type: EventType
    key: str
    user_id: int
    amount: int | None
    data: dict[str, Any]


def share_credited(c: CreditEntry, key: str) -> Record:
    """The event of a grab's credit (``key``: its journal row's, ``server.money.ledger.grab_key``)."""
    data = {"packet_id": c.packet_id, "user_id": c.user_id, "seq": c.seq, "amount": c.amount}
    return Record(type="share.credited", key=key, user_id=c.user_id, amount=c.amount, data=data)


def body(data: dict[str, Any]) -> str:
    return json.dumps(data, separators=(",", ":"), sort_keys=True)


async def record(
    tx: Tx,
    type: EventType,
    key: str,
    user_id: int,
    amount: int | None,
    data: dict[str, Any],
    ts: int,
    shard_id: int | None = None,
) -> None:
    """One event, in the caller's transaction. Its key is unique: a run again of the same
    ``Database.run`` call after a lost COMMIT answer finds its event there and adds none. ``shard_id``:
    the id that places it on a sharded ledger, the user's unless the transaction writes a packet's shard
    (``server.store.shards``)."""
    await tx.execute(
        "INSERT INTO events (type, idem_key, user_id, amount, body, created_ms, shard_id)"
        " VALUES (%s, %s, %s, %s, %s, %s, %s)" + tx.dialect.skip_duplicate("idem_key"),
        (type, key, user_id, amount, body(data), ts, user_id if shard_id is None else shard_id),
    )


async def record_many(tx: Tx, records: list[Record], ts: int) -> None:
    """Many new events in one statement, in the caller's transaction (the credit batch: its keys are new,
    as its journal rows are, or the batch fails with them)."""
    if records:
        await tx.executemany(
            "INSERT INTO events (type, idem_key, user_id, amount, body, created_ms, shard_id)"
            " VALUES (%s, %s, %s, %s, %s, %s, %s)",
            [
                (r["type"], r["key"], r["user_id"], r["amount"], body(r["data"]), ts, r["user_id"])
                for r in records
            ],
        )


# What a reader may see: events whose seq the counter has reached (on a sharded ledger, seqs are written
# shard by shard before the counter moves past them: ``_sequence_sharded``).
SEQUENCED = " AND seq <= (SELECT last_seq FROM event_counter WHERE name = 'events')"


async def sequence(db: Database) -> int:
    """Give every committed event without a seq the next seqs, in id order; returns how many. Any process
    may call it at any time (the dispatcher, the events API): one at a time holds the counter's lock."""
    done = 0
    while await db.fetchone("SELECT 1 FROM events WHERE seq IS NULL LIMIT 1") is not None:
        n = await _sequence_sharded(db) if db.shards else await db.run(_sequence_batch, idempotent=True)
        done += n
        if n < SEQUENCE_BATCH:
            break
    return done


async def _sequence_batch(tx: Tx) -> int:
    row = await tx.fetchone(
        "SELECT last_seq FROM event_counter WHERE name = 'events'" + tx.dialect.for_update, ()
    )
    if row is None:
        raise RuntimeError("event_counter has no row: run `redpacket migrate`")
    last = int(row[0])
    ids = [
        int(r[0])
        for r in await tx.fetchall(
            "SELECT id FROM events WHERE seq IS NULL ORDER BY id LIMIT %s", (SEQUENCE_BATCH,)
        )
    ]
    if not ids:
        return 0
    await _number(tx, {id_: last + i for i, id_ in enumerate(ids, start=1)})
    await tx.execute("UPDATE event_counter SET last_seq = %s WHERE name = 'events'", (last + len(ids),))
    return len(ids)


# One sequencing at a time per process on a sharded ledger: each holds the counter's row on one
# connection and numbers a shard's events on another, so many waiting on the lock at once (every read of
# the events API sequences first) would hold every pooled connection and leave the holder none.
_SEQUENCING: weakref.WeakKeyDictionary[Database, asyncio.Lock] = weakref.WeakKeyDictionary()


async def _sequence_sharded(db: Database) -> int:
    async with _SEQUENCING.setdefault(db, asyncio.Lock()):
        return await _sequence_shards(db)


async def _sequence_shards(db: Database) -> int:
    """``_sequence_batch`` on a sharded ledger, where no transaction writes two shards: the counter's row
    (on the head) stays locked while each shard's events get their seqs in a transaction of that shard;
    the counter moves past them last. A reader sees only seqs the counter has reached (``SEQUENCED``),
    so one written on a shard before another shard's smaller one is never read first; a run stopped
    half-way leaves seqs past the counter, which the next run starts after (``MAX(seq)``)."""
    async with db.transaction() as hold:
        row = await hold.fetchone(
            "SELECT last_seq FROM event_counter WHERE name = 'events'" + hold.dialect.for_update, ()
        )
        if row is None:
            raise RuntimeError("event_counter has no row: run `redpacket migrate`")
        top = await hold.fetchone("SELECT MAX(seq) FROM events")
        last = max(int(row[0]), int(top[0]) if top and top[0] is not None else 0)
        rows = await hold.fetchall(
            "SELECT id, shard_id FROM events WHERE seq IS NULL ORDER BY id LIMIT %s", (SEQUENCE_BATCH,)
        )
        numbered = {int(r[0]): last + i for i, r in enumerate(rows, start=1)}
        shards: dict[int, list[tuple[int, int]]] = {}
        for r in rows:
            shards.setdefault(shard_of(int(r[1] or 0), db.shards), []).append((int(r[0]), int(r[1] or 0)))
        for pairs in shards.values():
            seqs = {i: numbered[i] for i, _ in pairs}
            on = sorted({k for _, k in pairs})  # (names the shard column: Spider sends it to one backend)
            await db.run(lambda tx, seqs=seqs, on=on: _number(tx, seqs, on), idempotent=True)  # type: ignore[misc]
        if rows:
            await hold.execute(
                "UPDATE event_counter SET last_seq = %s WHERE name = 'events'", (last + len(rows),)
            )
        return len(rows)


async def _number(tx: Tx, seqs: dict[int, int], shard_ids: list[int] | None = None) -> None:
    """Events by id get these seqs (each still without one); ``shard_ids``: theirs, on a sharded ledger."""
    cases = " ".join(["WHEN %s THEN %s"] * len(seqs))
    marks = ", ".join(["%s"] * len(seqs))
    params: list[int] = [v for pair in seqs.items() for v in pair]
    on = f" AND shard_id IN ({', '.join(['%s'] * len(shard_ids))})" if shard_ids else ""
    changed = await tx.execute(
        f"UPDATE events SET seq = CASE id {cases} END WHERE id IN ({marks}) AND seq IS NULL{on}",
        [*params, *seqs, *(shard_ids or [])],
    )
    if changed != len(seqs):
        raise RuntimeError(f"sequenced {changed} of {len(seqs)} events: another sequencer ran unlocked")


def _event(row: tuple[Any, ...]) -> Event:
    seq, type_, user, data, created = row
    return Event(
        id=int(seq),
        type=str(type_),
        created_ms=int(created),
        user_id=int(user),
        data=json.loads(as_text(data)),
    )


async def page(db: Database, *, after: int, limit: int) -> list[Event]:
    """The events after seq ``after``, oldest first, at most ``limit`` (everything committed is sequenced
    first, so a reader is not made to wait for a worker)."""
    await sequence(db)
    rows = await db.fetchall(
        "SELECT seq, type, user_id, body, created_ms FROM events WHERE seq > %s"
        + SEQUENCED
        + " ORDER BY seq LIMIT %s",
        (after, limit),
    )
    return [_event(tuple(r)) for r in rows]


async def by_seq(db: Database, seqs: list[int]) -> dict[int, Event]:
    """Events by their seqs (the dispatcher's claimed deliveries)."""
    if not seqs:
        return {}
    marks = ", ".join(["%s"] * len(seqs))
    rows = await db.fetchall(
        f"SELECT seq, type, user_id, body, created_ms FROM events WHERE seq IN ({marks})", seqs
    )
    return {int(r[0]): _event(tuple(r)) for r in rows}


async def last_seq(db: Database) -> int:
    row = await db.fetchone("SELECT last_seq FROM event_counter WHERE name = 'events'")
    return int(row[0]) if row else 0


async def seq_at(db: Database, since_ms: int) -> int:
    """The seq before the first event created at or after ``since_ms`` (for a replay from a time)."""
    await sequence(db)
    row = await db.fetchone(
        "SELECT MIN(seq) FROM events WHERE created_ms >= %s AND seq IS NOT NULL", (since_ms,)
    )
    return int(row[0]) - 1 if row and row[0] is not None else await last_seq(db)
