"""The webhook deliveries' queue, in the database beside the events it delivers.

Per webhook URL (``endpoint``: a hash of it), ``queue`` copies every new event (by seq, after the URL's
cursor) into a delivery row — of the event types the URL takes only (``server.money.endpoints``): the others
are never queued for it. A dispatcher ``claim``s due rows under a lease: a conditional UPDATE that
one dispatcher wins per row, so two never both send one event in one round; ``ack`` marks a row
delivered only while the claim's lease token is still its own, so a dispatcher that lost its lease (it
stalled past it and another took the row) never acknowledges it. A dispatcher killed mid-delivery leaves
its rows leased until the lease ends; then they are due again (a receiver dedupes by event id).

**Order per user**: a row is claimed only when no earlier row of the same user and URL is undelivered,
so a user's events reach a URL one at a time, in order (a failing one holds that user's later events back,
not other users'; given up as ``failed`` after ``REDPACKET_WEBHOOK_GIVE_UP_HOURS``, it no longer does).
"""

from __future__ import annotations

import functools
import hashlib
import secrets
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from server.money import events
from server.store.db import Database, Tx

# Events copied into the queue per URL per call.
QUEUE_BATCH = 1000


def endpoint_id(url: str) -> str:
    """A URL's key in the queue: changing the list of URLs keeps each one's queue."""
    return hashlib.sha256(url.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Claimed:
    seq: int
    attempts: int
    first_ms: int
    event: events.Event


async def queue(db: Database, endpoint: str, now: int, types: Collection[str] | None = None) -> int:
    """Copy events past ``endpoint``'s cursor into its deliveries (of ``types`` only, when given; the
    cursor passes the others all the same); returns how many. A URL seen for the first time starts from
    the first event: a backend that adds webhooks later is sent the history first (it dedupes by id what it
    has), and no event made before a worker ran with the URL is skipped."""

    async def work(tx: Tx) -> int:
        row = await tx.fetchone(
            "SELECT after_seq FROM webhook_cursors WHERE endpoint = %s" + tx.dialect.for_update, (endpoint,)
        )
        if row is None:
            await tx.execute(
                "INSERT INTO webhook_cursors (endpoint, after_seq) VALUES (%s, 0)"
                + tx.dialect.skip_duplicate("endpoint"),
                (endpoint,),
            )
            row = await tx.fetchone(
                "SELECT after_seq FROM webhook_cursors WHERE endpoint = %s" + tx.dialect.for_update,
                (endpoint,),
            )
            assert row is not None
        after = int(row[0])
        new = await events.read_after(tx, after, QUEUE_BATCH)
        if not new:
            return 0
        wanted = [e for e in new if types is None or e["type"] in types]
        await _add(tx, endpoint, wanted, now)
        await tx.execute(
            "UPDATE webhook_cursors SET after_seq = %s WHERE endpoint = %s", (new[-1]["id"], endpoint)
        )
        return len(wanted)

    return await db.run(work, idempotent=True)


async def _add(tx: Tx, endpoint: str, events_: Sequence[events.Event], now: int) -> None:
    """New deliveries, due now, of these events to ``endpoint``."""
    if not events_:
        return
    await tx.executemany(
        "INSERT INTO webhook_deliveries (endpoint, seq, user_id, type, state, attempts, next_ms, lease_ms,"
        " lease_token, first_ms) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",  # (one multi-row INSERT)
        [(endpoint, e["id"], e["user_id"], e["type"], "pending", 0, now, 0, 0, now) for e in events_],
    )


async def claim(
    db: Database, endpoint: str, now: int, lease_ms: int, limit: int
) -> tuple[int, list[Claimed]]:
    """Lease up to ``limit`` due deliveries of ``endpoint``, each the oldest undelivered of its user;
    returns the lease's token and them, oldest first."""
    token = secrets.randbits(62) + 1

    async def work(tx: Tx) -> list[tuple[int, int, int]]:
        due = await tx.fetchall(
            "SELECT d.seq FROM webhook_deliveries d"
            " WHERE d.endpoint = %s AND d.state = 'pending' AND d.next_ms <= %s AND d.lease_ms <= %s"
            " AND NOT EXISTS (SELECT 1 FROM webhook_deliveries e WHERE e.endpoint = d.endpoint"
            " AND e.user_id = d.user_id AND e.state = 'pending' AND e.seq < d.seq)"
            " ORDER BY d.seq LIMIT %s",
            (endpoint, now, now, limit),
        )
        seqs = [int(r[0]) for r in due]
        if not seqs:
            return []
        marks = ", ".join(["%s"] * len(seqs))
        await tx.execute(
            "UPDATE webhook_deliveries SET lease_ms = %s, lease_token = %s, attempts = attempts + 1"
            f" WHERE endpoint = %s AND seq IN ({marks}) AND state = 'pending' AND lease_ms <= %s",
            [now + lease_ms, token, endpoint, *seqs, now],
        )
        won = await tx.fetchall(
            f"SELECT seq, attempts, first_ms FROM webhook_deliveries WHERE endpoint = %s AND seq IN ({marks})"
            " AND lease_token = %s",
            [endpoint, *seqs, token],
        )
        return sorted((int(s), int(a), int(f)) for s, a, f in won)

    won = await db.run(work, idempotent=True)  # a run again finds its rows leased: they wait the lease
    found = await events.by_seq(db, [s for s, _, _ in won])
    return token, [Claimed(s, a, f, found[s]) for s, a, f in won if s in found]


async def ack(db: Database, endpoint: str, seq: int, token: int, now: int) -> bool:
    """Delivered: True if this claim still held the row (it is now ``delivered``), False if its lease
    had passed to another dispatcher."""

    async def work(tx: Tx) -> int:
        changed = await tx.execute(
            "UPDATE webhook_deliveries SET state = 'delivered', done_ms = %s, last_error = NULL"
            " WHERE endpoint = %s AND seq = %s AND lease_token = %s AND state = 'pending'",
            (now, endpoint, seq, token),
        )
        if changed or not tx.resumed:
            return changed
        # Run again after a lost COMMIT answer: the first run's acknowledgement is this call's own.
        mine = await tx.fetchone(
            "SELECT 1 FROM webhook_deliveries WHERE endpoint = %s AND seq = %s AND lease_token = %s"
            " AND state = 'delivered'",
            (endpoint, seq, token),
        )
        return 1 if mine else 0

    return await db.run(work, idempotent=True) == 1


async def retry_later(
    db: Database, endpoint: str, seq: int, token: int, *, next_ms: int, error: str, give_up: bool
) -> bool:
    """Not delivered: due again at ``next_ms``, or ``failed`` for good with ``give_up``."""

    async def work(tx: Tx) -> int:
        return await tx.execute(
            "UPDATE webhook_deliveries SET state = %s, next_ms = %s, lease_ms = 0, last_error = %s,"
            " done_ms = %s WHERE endpoint = %s AND seq = %s AND lease_token = %s AND state = 'pending'",
            (
                *("failed" if give_up else "pending", next_ms, error[:200], next_ms if give_up else None),
                *(endpoint, seq, token),
            ),
        )

    return await db.run(work, idempotent=True) == 1


async def replay(
    db: Database,
    endpoints: list[str],
    after_seq: int,
    now: int,
    types: Mapping[str, Collection[str] | None] | None = None,
) -> int:
    """Every event after ``after_seq`` due again for each endpoint (delivered, failed or never queued) —
    of the endpoint's ``types`` only, when given: the same event ids, so a receiver that has some
    already drops them. A delivery in flight loses its lease (its answer no longer acknowledges it: it
    is sent again). In transactions of ``QUEUE_BATCH`` events, so the dispatchers are not held up.
    Returns deliveries made due."""
    total = 0
    for endpoint in endpoints:
        only = (types or {}).get(endpoint)
        await queue(db, endpoint, now, only)  # the cursor exists
        cursor = await db.fetchone("SELECT after_seq FROM webhook_cursors WHERE endpoint = %s", (endpoint,))
        last = int(cursor[0]) if cursor else 0
        start = after_seq
        while start < last:
            end = min(start + QUEUE_BATCH, last)
            total += await db.run(
                functools.partial(
                    _replay_batch, endpoint=endpoint, after=start, upto=end, now=now, types=only
                ),
                idempotent=True,
            )
            start = end
    return total


async def _replay_batch(
    tx: Tx, *, endpoint: str, after: int, upto: int, now: int, types: Collection[str] | None
) -> int:
    # (Only the types the URL takes now: a row of a type it took once stays as it was.)
    marks = ", ".join(["%s"] * len(types)) if types else ""
    changed = await tx.execute(
        "UPDATE webhook_deliveries SET state = 'pending', next_ms = %s, lease_ms = 0, lease_token = 0,"
        " done_ms = NULL, attempts = 0, first_ms = %s WHERE endpoint = %s AND seq > %s AND seq <= %s"
        + (f" AND type IN ({marks})" if types else ""),
        (now, now, endpoint, after, upto, *(types or ())),
    )
    # Events before the URL's cursor that were never queued for it (made before its queue existed).
    queued = {
        int(r[0])
        for r in await tx.fetchall(
            "SELECT seq FROM webhook_deliveries WHERE endpoint = %s AND seq > %s AND seq <= %s",
            (endpoint, after, upto),
        )
    }
    missing = [
        e
        for e in await events.read_after(tx, after, upto - after)
        if e["id"] <= upto and e["id"] not in queued and (types is None or e["type"] in types)
    ]
    await _add(tx, endpoint, missing, now)
    return changed + len(missing)


@dataclass(frozen=True)
class QueueState:
    pending: int
    failed: int
    oldest_pending_ms: int | None  # first_ms of the oldest undelivered
    queued: bool = True  # False: no worker has run with this URL yet


async def state(db: Database, endpoint: str) -> QueueState:
    rows = await db.fetchall(
        "SELECT state, COUNT(*), MIN(first_ms) FROM webhook_deliveries"
        " WHERE endpoint = %s AND state IN ('pending', 'failed') GROUP BY state",
        (endpoint,),
    )
    by = {str(s): (int(n), None if m is None else int(m)) for s, n, m in rows}
    pending = by.get("pending", (0, None))
    cursor = await db.fetchone("SELECT 1 FROM webhook_cursors WHERE endpoint = %s", (endpoint,))
    return QueueState(pending[0], by.get("failed", (0, None))[0], pending[1], cursor is not None)


Status = Literal["pending", "delivered", "failed"]
STATUSES: tuple[Status, ...] = ("pending", "delivered", "failed")
_VIEW = (
    "SELECT d.seq, d.type, d.state, d.attempts, d.last_error, d.next_ms, d.first_ms, d.done_ms"
    " FROM webhook_deliveries d WHERE d.endpoint = %s"
)


def _view(row: tuple[Any, ...]) -> dict[str, Any]:
    seq, type_, state, attempts, error, next_ms, first_ms, done_ms = row
    return {
        "event_id": int(seq),
        "type": str(type_),
        "status": str(state),
        "attempts": int(attempts),
        "last_error": None if error is None else str(error),
        "next_try_ms": int(next_ms) if state == "pending" else None,
        "first_try_ms": int(first_ms),
        "done_ms": None if done_ms is None else int(done_ms),
    }


async def listing(
    db: Database, endpoint: str, *, after: int, limit: int, status: Status | None = None
) -> list[dict[str, Any]]:
    """``endpoint``'s deliveries after event id ``after``, oldest first, at most ``limit`` (of one
    ``status`` when given), as the service API shows them."""
    rows = await db.fetchall(
        _VIEW + (" AND d.state = %s" if status else "") + " AND d.seq > %s ORDER BY d.seq LIMIT %s",
        (endpoint, *((status,) if status else ()), after, limit),
    )
    return [_view(tuple(r)) for r in rows]


async def one(db: Database, endpoint: str, seq: int) -> dict[str, Any] | None:
    """The delivery of event ``seq`` to ``endpoint``, or None (not queued for it: yet, or not its type)."""
    row = await db.fetchone(_VIEW + " AND d.seq = %s", (endpoint, seq))
    return None if row is None else _view(tuple(row))


async def last_queued(db: Database, endpoint: str) -> int:
    """The newest event id ``endpoint``'s queue has looked at (0 before its first ``queue``)."""
    row = await db.fetchone("SELECT after_seq FROM webhook_cursors WHERE endpoint = %s", (endpoint,))
    return int(row[0]) if row else 0


async def of_events(db: Database, endpoint: str, seqs: list[int]) -> list[dict[str, Any]]:
    """``endpoint``'s deliveries of these events (those queued for it), as ``listing`` shows them."""
    if not seqs:
        return []
    rows = await db.fetchall(
        _VIEW + f" AND d.seq IN ({', '.join(['%s'] * len(seqs))}) ORDER BY d.seq", (endpoint, *seqs)
    )
    return [_view(tuple(r)) for r in rows]
