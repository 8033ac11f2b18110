"""Crediting grabs exactly once: many in one transaction (``credit_many``), or one alone (``credit_grab``,
``credit_or_record``: a batch of one). Every rule is ``server.money.creditrules``'s; here is how a batch
is written. The usual batch (every grab new) is decided by those rules as if no record were held, after one
read of its packets' shares says each share is the database's, and its grab records are simply inserted:
the unique keys refuse a share or a user already held, and then that insert is undone and every credit is
decided from the grab records read (``_decide``). If another worker credited one of these grabs after that
read the batch rolls back on the unique keys and falls back to crediting one by one; either way each grab
is paid once. (The packet row lock each credit takes first makes that clash rare: only a payer that skipped
the lock meets it.) Then multi-row inserts and one balance update per account, accounts in a fixed order
so two batches never deadlock, and the paid count on each packet's row raised. On a sharded ledger the
same rules run in steps (``server.money.shardsteps``).

A credit refused (its grabber was told "won", or can read it with ``open``, and the ledger will not pay it)
is never only logged: it is a row of ``credit_refusals``, written in the transaction that decided it, and
reconciliation reports every one not paid since (``server.money.reconcile``).
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import assert_never

from server.errors import RedPacketError
from server.money import shardsteps
from server.money.creditrules import (
    Held,
    Outcome,
    Refusal,
    RefusedBy,
    against_journal,
    decide,
    lock_packets,
    read_held,
    read_posted,
    record_refusals,
    refusal_error,
    refusal_of,
    refused,
)
from server.money.journal import Posting, marks, post_many
from server.money.ledger import CreditOutcome, finish_paid, grab_key, now_ms
from server.money.statuses import PacketStatus, RecordStatus
from server.store.db import Database, IntegrityError, Tx, as_text
from server.store.records import CreditEntry


async def credit_many(
    db: Database, credits: list[CreditEntry], refused_by: RefusedBy = "drain", partial: bool = False
) -> list[Outcome]:
    """Credit every grab in ``credits``; one outcome per credit, in order. A refusal is recorded before
    this returns (in the same transaction as the credits, or in one of its own on the fallback).

    Cancelled before the commit: nothing is written and every grab can be credited again later. Run
    again after a lost COMMIT answer, a grab the first run paid still counts as ``credited``. ``partial``
    (the drain): on a sharded ledger, the credits of a shard that cannot be reached now come out
    ``later`` (``creditrules.LATER``) and the rest are paid.
    """
    if not credits:
        return []
    if db.shards:  # no transaction may write two shards: the three steps of server.money.shardsteps
        return await shardsteps.credit_many(db, credits, refused_by, partial)
    try:
        return await db.run(lambda tx: _batch(tx, credits, refused_by), idempotent=True)
    except (IntegrityError, RedPacketError):
        # Another payer's row met on a unique key, or one credit the batch cannot take (a grabber with
        # no account): one by one, each decided on its own.
        out: list[Outcome] = []
        for c in credits:
            out.append(await credit_or_record(db, c, refused_by))
        return out


async def credit_grab(db: Database, c: CreditEntry) -> CreditOutcome:
    """Pay one grab alone — its grab record, journal row and balance change in one transaction — by the
    batch's rules for a batch of one: ``credited`` (by this call, even one run again after a lost COMMIT
    answer) or ``already``. A refusal raises its error (``creditrules.refusal_error``: the share not this
    user's or not this amount, the packet refunded or unknown) and records nothing. Cancelled before the
    commit: nothing is written."""
    outcome = await _alone(db, c, None)
    match outcome:
        case "credited":
            return "credited"
        case "already":
            return "already"
        case "later":  # (a whole ledger is asked: nothing is left for later)
            raise RuntimeError(f"credit of share {c.seq} of packet {c.packet_id} left for later")
        case Refusal():
            raise refusal_error(outcome, c)
        case _:
            assert_never(outcome)


async def credit_or_record(db: Database, c: CreditEntry, refused_by: RefusedBy) -> Outcome:
    """One grab alone, by the batch's rules; a refusal recorded (``record_refusals``) before its code is
    returned."""
    return await _alone(db, c, refused_by)


ALONE_TRIES = 3  # a batch of one that meets another payer's row between its read and its write


async def _alone(db: Database, c: CreditEntry, refused_by: RefusedBy | None) -> Outcome:
    if db.shards:
        return (await shardsteps.credit_many(db, [c], refused_by))[0]
    for attempt in range(ALONE_TRIES):
        try:
            return (await db.run(lambda tx: _batch(tx, [c], refused_by), idempotent=True))[0]
        except IntegrityError:
            if attempt == ALONE_TRIES - 1:  # (the rows it met are read and decided on the next try)
                raise
        except RedPacketError as e:
            code = refusal_of(e.code)  # (a grabber with no account: met by the balance update)
            if code is None:
                raise  # the database away, say: nothing decided, try again later
            record = functools.partial(record_refusals, refused=[(c, code)], refused_by=refused_by)
            await db.run(record, idempotent=True)
            return code
    raise AssertionError("unreachable")


async def _batch(tx: Tx, credits: list[CreditEntry], refused_by: RefusedBy | None) -> list[Outcome]:
    status = await lock_packets(tx, sorted({c.packet_id for c in credits}))
    if await _all_new(tx, credits, status):
        return ["credited"] * len(credits)
    return await _decide(tx, credits, status, refused_by)


async def _all_new(tx: Tx, credits: list[CreditEntry], status: dict[int, PacketStatus]) -> bool:
    """The usual batch, paid without reading a grab record: one read says every share is the one the
    database pre-split, the rules (``creditrules.decide``) pay every credit as if no record were held, and
    the grab records are written at once. A record already held (the unique keys refuse the insert, which
    is undone to the savepoint) or any other doubt: False, nothing written, and ``_decide`` reads and
    decides each one."""
    _, inserts, _ = decide(
        credits, status, Held(shares={(c.packet_id, c.seq): c.amount for c in credits}), set()
    )
    if len(inserts) != len(credits):  # a refusal, or a share or user twice in the batch
        return False
    if not await _shares_match(tx, credits):
        return False
    ts = now_ms()
    await tx.execute("SAVEPOINT credit_batch")
    try:
        await _insert_records(tx, credits, ts)
        await _post(tx, credits, ts)
        await finish_paid(tx, Counter(c.packet_id for c in credits))
    except IntegrityError:
        # Another payer holds one of these shares or users (or a run before a lost COMMIT answer paid
        # them), or a grab key is in the journal already: undo the batch's rows (SQLite's executemany may
        # have written some) and decide each one on what is there.
        await tx.execute("ROLLBACK TO SAVEPOINT credit_batch")
        return False
    return True


async def _shares_match(tx: Tx, credits: list[CreditEntry]) -> bool:
    """Whether every credit names a share the database pre-split, for its amount: per packet, its shares
    from the batch's lowest seq to its highest, read as one string of ``seq:amount`` (a seq range is
    read on the primary key, and one string is parsed at once: 500 ``(seq, amount)`` pairs in an IN
    list cost MariaDB 1.0-1.3 ms to parse, this 0.3 ms, docs/benchmarks.md). Each item ends in ``;``: in
    a string the server cut short (``group_concat_max_len``, with only a warning) the item cut matches no
    credit, and neither does one cut off; then False, and each credit is read."""
    ranges: dict[int, tuple[int, int]] = {}
    for c in credits:
        lo, hi = ranges.get(c.packet_id, (c.seq, c.seq))
        ranges[c.packet_id] = (min(lo, c.seq), max(hi, c.seq))
    pairs = tx.dialect.concat("seq", "':'", "amount", "';'")
    rows = await tx.fetchall(
        f"SELECT packet_id, GROUP_CONCAT({pairs}) FROM red_packet_shares WHERE "
        + " OR ".join(["(packet_id = %s AND seq BETWEEN %s AND %s)"] * len(ranges))
        + " GROUP BY packet_id",
        [x for pid, (lo, hi) in ranges.items() for x in (pid, lo, hi)],
    )
    shares = {int(pid): set(as_text(text).split(",")) for pid, text in rows}
    none: set[str] = set()
    return all(f"{c.seq}:{c.amount};" in shares.get(c.packet_id, none) for c in credits)


async def _insert_records(tx: Tx, credits: list[CreditEntry], ts: int) -> None:
    credited = RecordStatus.CREDITED.value  # (a plain str: bound as one, and looked up once a batch)
    await tx.executemany(
        "INSERT INTO grab_records (packet_id, user_id, seq, amount, status, grabbed_ms, credited_ms)"
        " VALUES (%s, %s, %s, %s, %s, %s, %s)",
        [(c.packet_id, c.user_id, c.seq, c.amount, credited, c.grabbed_ms, ts) for c in credits],
    )


async def _post(tx: Tx, paid: list[CreditEntry], ts: int) -> None:
    """The journal rows and balances of ``paid`` (their grab records written)."""
    await post_many(
        tx,
        [Posting(c.user_id, c.amount, "grab", grab_key(c.packet_id, c.seq), c.packet_id) for c in paid],
        ts,
    )


async def _decide(
    tx: Tx, credits: list[CreditEntry], status: dict[int, PacketStatus], refused_by: RefusedBy | None
) -> list[Outcome]:
    """Each credit decided from what the database holds (``creditrules.decide``); the refused recorded."""
    held = await read_held(tx, credits)
    # A run again after a lost COMMIT answer: the shares the first run paid (their journal rows carry this
    # call's token) are still this call's credits, not another worker's.
    mine = await _paid_by_this_call(tx, credits) if tx.resumed else set()
    out, inserts, updates = decide(credits, status, held, mine)
    out, there, taken = against_journal(
        credits, out, inserts + updates, await read_posted(tx, inserts + updates)
    )
    inserts = [c for c in inserts if (c.packet_id, c.seq) not in taken]
    updates = [c for c in updates if (c.packet_id, c.seq) not in taken]
    ts = now_ms()
    await _insert_records(tx, inserts, ts)
    for c in updates:
        await tx.execute(
            f"UPDATE grab_records SET status = '{RecordStatus.CREDITED}', credited_ms = %s WHERE packet_id"
            " = %s AND seq = %s",
            (ts, c.packet_id, c.seq),
        )
    await _post(tx, [c for c in inserts + updates if (c.packet_id, c.seq) not in there], ts)
    # Every record marked paid now, its posting made now or before (``there``): one may be the last share.
    await finish_paid(tx, Counter(c.packet_id for c in inserts + updates))
    await record_refusals(tx, refused(credits, out), refused_by)
    return out


async def _paid_by_this_call(tx: Tx, credits: list[CreditEntry]) -> set[tuple[int, int]]:
    """(packet, seq) of the credits whose journal row this ``Database.run`` call wrote in an earlier run."""
    keys = {grab_key(c.packet_id, c.seq): (c.packet_id, c.seq) for c in credits}
    rows = await tx.fetchall(
        f"SELECT idem_key FROM journal WHERE tx = %s AND idem_key IN ({marks(len(keys))})",
        [tx.token, *keys],
    )
    return {keys[as_text(r[0])] for r in rows}
