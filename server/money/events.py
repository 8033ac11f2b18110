"""The event outbox: what happened to the money, for the chat backend (webhooks and ``GET
/api/service/events``).

An event is written by ``record`` in the very transaction of the change it reports, so it exists exactly
when the change does: a rolled-back send leaves no ``packet.sent``, and a committed credit always has its
``share.credited``. A money event's key is its journal row's idempotency key (and its ``amount`` the
row's), so reconciliation matches the two one for one — but a credit batch's, below.

**The credits of a batch are one row** (``record_credits``, written by ``journal.post_many`` beside their
journal rows): ``n`` events, keyed ``credits:<token>`` by the transaction's token, which each of its grab
journal rows carries too. They are read back one event per journal row, in the rows' id order, from the
journal itself (``_read``): the event of a credit says what its journal row says, and a 500-credit batch
writes one event row instead of 500 (that row was a fifth of the batch's time: ``docs/benchmarks.md``).

An event's public id is ``seq``, given by ``sequence`` after commit, in the order events are found
committed. Auto-increment ids are not that: a transaction that took id 10 may commit after one that took
id 11, and a reader who had paged past 11 would never see 10. A seq is only given to committed rows, one
batch at a time under a lock, so every later seq is larger than every earlier one: paging ``after`` a seq
never skips an event. A row of ``n`` events takes ``n`` seqs, and its ``seq`` column holds the last of
them (``seq - n + 1`` … ``seq``). Per user, the events of balance changes get their seqs in the order the
changes committed (a change locks the user's account row, and its event is written after the lock).
"""

from __future__ import annotations

import asyncio
import json
import logging
import weakref
from collections.abc import Sequence
from typing import Any, Literal, Protocol, TypedDict

from server.ids import PacketId, ShareSeq
from server.store.db import Database, Row, Tx, as_text
from server.store.shards import shard_of

log = logging.getLogger(__name__)

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
# The most event rows one sequencing transaction numbers (a row of credits holds many events), and the
# most events one page of the events API holds.
SEQUENCE_BATCH = 1000
MAX_PAGE = 500


class Event(TypedDict):
    """An event as the backend receives it (a webhook's body, an item of the events API)."""

    id: int
    type: str
    created_ms: int
    user_id: int
    data: dict[str, Any]


def grab_key(packet_id: PacketId, seq: ShareSeq) -> str:
    """A grab's credit's journal key: one share of one packet paid once (``reconcile`` builds it in SQL;
    ``share_of`` reads it back)."""
    return f"grab:{packet_id}:{seq}"


def share_of(key: str) -> int:
    """The share seq a grab key names (``grab_key``'s last part)."""
    return int(key.rsplit(":", 1)[1])


def credits_key(token: int) -> str:
    """The key of the event row of the credits a transaction posts: its token's (``Tx.token``)."""
    return f"credits:{token}"


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


async def record_credits(tx: Tx, n: int, total: int, ts: int, shard_id: int) -> None:
    """The ``share.credited`` events of the ``n`` grab journal rows (``total`` cents) this transaction
    posts, as one row, in the caller's transaction (``journal.post_many``: once per transaction, or
    its key is met again and the transaction rolls back). Its events are the grab journal rows carrying
    the transaction's token and written at ``ts`` (a random token alone might, once in 2^63, be another
    transaction's too: an older one, or one on another shard, where this key is not unique)."""
    await tx.execute(
        "INSERT INTO events (type, idem_key, user_id, amount, body, created_ms, shard_id, n, tx)"
        " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s)",
        ("share.credited", credits_key(tx.token), 0, total, "{}", ts, shard_id, n, tx.token),
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
    rows = await tx.fetchall(
        "SELECT id, n FROM events WHERE seq IS NULL ORDER BY id LIMIT %s", (SEQUENCE_BATCH,)
    )
    if not rows:
        return 0
    seqs, last = _seqs(int(row[0]), rows)
    await _number(tx, seqs)
    await tx.execute("UPDATE event_counter SET last_seq = %s WHERE name = 'events'", (last,))
    return len(rows)


def _seqs(last: int, rows: Sequence[Row]) -> tuple[dict[int, int], int]:
    """Each ``(id, n)`` row's seq (its last event's), numbering on from ``last``; and the new last."""
    seqs: dict[int, int] = {}
    for id_, n in rows:
        last += int(n)
        seqs[int(id_)] = last
    return seqs, last


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
            "SELECT id, n, shard_id FROM events WHERE seq IS NULL ORDER BY id LIMIT %s", (SEQUENCE_BATCH,)
        )
        numbered, top_seq = _seqs(last, [r[:2] for r in rows])
        shards: dict[int, list[tuple[int, int]]] = {}
        for r in rows:
            shards.setdefault(shard_of(int(r[2] or 0), db.shards), []).append((int(r[0]), int(r[2] or 0)))
        for pairs in shards.values():
            seqs = {i: numbered[i] for i, _ in pairs}
            on = sorted({k for _, k in pairs})  # (names the shard column: Spider sends it to one backend)
            await db.run(lambda tx, seqs=seqs, on=on: _number(tx, seqs, on), idempotent=True)  # type: ignore[misc]
        if rows:
            await hold.execute("UPDATE event_counter SET last_seq = %s WHERE name = 'events'", (top_seq,))
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


# An event row as read: its last seq, how many events it holds, and the rest.
_COLUMNS = "seq, n, type, user_id, body, created_ms, tx"


class Reader(Protocol):
    async def fetchall(self, statement: str, params: Sequence[Any] = ...) -> list[Row]: ...


async def _read(reader: Reader, rows: Sequence[Row]) -> list[Event]:
    """The events of these rows, in seq order: a row of one event as written; a row of credits one
    event per grab journal row its transaction posted, in id order, from the journal."""
    tokens = sorted({int(r[6]) for r in rows if r[6] is not None})
    posted: dict[tuple[int, int], list[Row]] = {}  # (token, created_ms) → its grab journal rows
    if tokens:
        for r in await reader.fetchall(
            "SELECT tx, account_id, amount, packet_id, idem_key, created_ms FROM journal"
            f" WHERE tx IN ({', '.join(['%s'] * len(tokens))}) AND kind = 'grab' ORDER BY id",
            tokens,
        ):
            posted.setdefault((int(r[0]), int(r[5])), []).append(r[:5])
    out: list[Event] = []
    for seq, n, type_, user, data, created, token in rows:
        if token is None:
            e = Event(id=int(seq), type=str(type_), created_ms=int(created), user_id=int(user), data={})
            e["data"] = json.loads(as_text(data))
            out.append(e)
            continue
        credits = posted.get((int(token), int(created)), [])
        if len(credits) != int(n):  # (reconcile reports it: event_credits)
            log.error("credits:%s holds %s events; its transaction posted %s", token, n, len(credits))
        first = int(seq) - int(n) + 1
        out += [_credit(first + i, int(created), r) for i, r in enumerate(credits[: int(n)])]
    return out


def _credit(seq: int, created_ms: int, row: Row) -> Event:
    """The ``share.credited`` event of a grab journal row (tx, account, amount, packet, key)."""
    _, account, amount, packet, key = row
    user = int(account)
    data = {"amount": int(amount), "packet_id": int(packet), "seq": share_of(as_text(key)), "user_id": user}
    return Event(id=seq, type="share.credited", created_ms=created_ms, user_id=user, data=data)


async def read_after(reader: Reader, after: int, limit: int) -> list[Event]:
    """The sequenced events after seq ``after``, oldest first, at most ``limit`` (only the rows that hold
    them are read back)."""
    while True:
        rows = await reader.fetchall(
            f"SELECT {_COLUMNS} FROM events WHERE seq > %s" + SEQUENCED + " ORDER BY seq LIMIT %s",
            (after, limit),
        )
        held, count = [], 0
        for r in rows:
            held.append(r)
            count += min(int(r[1]), int(r[0]) - after)
            if count >= limit:
                break
        found = [e for e in await _read(reader, held) if e["id"] > after][:limit]
        if found or not held:
            return found
        # Rows of credits whose journal rows are not there (logged; reconcile reports it): not a reason
        # to stop every reader before them.
        after = int(held[-1][0])


async def page(db: Database, *, after: int, limit: int) -> list[Event]:
    """The events after seq ``after``, oldest first, at most ``limit`` (everything committed is sequenced
    first, so a reader is not made to wait for a worker)."""
    await sequence(db)
    return await read_after(db, after, limit)


async def by_seq(db: Database, seqs: list[int]) -> dict[int, Event]:
    """Events by their seqs (the dispatcher's claimed deliveries). The row holding seq ``s`` is the first
    whose last seq is ``s`` or more; one read finds the rows of seqs close together."""
    wanted = sorted(set(seqs))
    found: dict[int, Event] = {}
    while wanted:
        rows = await db.fetchall(
            f"SELECT {_COLUMNS} FROM events WHERE seq >= %s ORDER BY seq LIMIT %s", (wanted[0], len(wanted))
        )
        if not rows:
            break
        for e in await _read(db, rows):
            found[e["id"]] = e
        last = int(rows[-1][0])  # (every seq up to their last that exists is in the rows read)
        wanted = [s for s in wanted if s > last]
    return {s: found[s] for s in sorted(set(seqs)) if s in found}


async def last_seq(db: Database) -> int:
    row = await db.fetchone("SELECT last_seq FROM event_counter WHERE name = 'events'")
    return int(row[0]) if row else 0


async def seq_at(db: Database, since_ms: int) -> int:
    """The seq before the first event created at or after ``since_ms`` (for a replay from a time)."""
    await sequence(db)
    row = await db.fetchone(
        "SELECT MIN(seq - n + 1) FROM events WHERE created_ms >= %s AND seq IS NOT NULL", (since_ms,)
    )
    return int(row[0]) - 1 if row and row[0] is not None else await last_seq(db)


async def of_packet(db: Database, packet_id: int, keys: list[str], tokens: list[int]) -> list[Event]:
    """The numbered events about one packet, oldest first: those keyed ``keys`` (its journal rows' and
    its ``packet.finished``), and the credits among the rows of the transactions ``tokens`` (those that
    paid its grabs). Everything committed is numbered first (``sequence``), as ``page`` does."""
    await sequence(db)
    rows: list[Row] = []
    if keys:
        rows += await db.fetchall(
            f"SELECT {_COLUMNS} FROM events WHERE idem_key IN ({', '.join(['%s'] * len(keys))})"
            " AND seq IS NOT NULL" + SEQUENCED,
            keys,
        )
    if tokens:
        rows += await db.fetchall(
            f"SELECT {_COLUMNS} FROM events WHERE tx IN ({', '.join(['%s'] * len(tokens))})"
            " AND seq IS NOT NULL" + SEQUENCED,
            tokens,
        )
    found = await _read(db, sorted(rows, key=lambda r: int(r[0])))
    mine = [e for e in found if e["type"] != "share.credited" or e["data"].get("packet_id") == packet_id]
    return sorted(mine, key=lambda e: e["id"])
