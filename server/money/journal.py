"""The journal, append-only, and the balances it sums to: its one writer.

Every balance change is a journal row with a unique idempotency key and the matching balance update, in
the caller's transaction, written here and nowhere else: ``post`` one change (a debit checked against the
balance, a key met again told from a reuse), ``post_many`` the credits of a batch (one multi-row insert,
one balance update for many accounts). Both append through ``_append``, the one INSERT of the journal.
For every account the journal sums to the balance (``journal_sum``; ``redpacket reconcile`` checks it).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Literal, NamedTuple, TypedDict

from server import errors
from server.errors import Conflict, NotFound, RedPacketError
from server.ids import UserId
from server.money import events
from server.store.db import Database, IntegrityError, Tx, as_text

JournalKind = Literal["topup", "send", "grab", "refund", "withdraw", "hold", "release"]


def now_ms() -> int:
    return int(time.time() * 1000)


class Posting(NamedTuple):
    """One journal row to write: ``amount`` cents to ``account_id``, under ``idem_key``. (A named tuple:
    a credit batch makes hundreds, each in a third of a frozen dataclass's time.)"""

    account_id: int
    amount: int
    kind: JournalKind
    idem_key: str
    packet_id: int | None = None


async def _append(tx: Tx, rows: Sequence[Posting], ts: int) -> None:
    """The journal's one INSERT: ``rows`` appended, each carrying this call's ``tx.token`` (how a run after
    a lost COMMIT answer knows its own rows). Every value a placeholder: the driver then sends one
    multi-row INSERT, not one each."""
    await tx.executemany(
        "INSERT INTO journal (account_id, amount, kind, idem_key, packet_id, created_ms, tx)"
        " VALUES (%s, %s, %s, %s, %s, %s, %s)",
        [(p.account_id, p.amount, p.kind, p.idem_key, p.packet_id, ts, tx.token) for p in rows],
    )


async def post(
    tx: Tx,
    account_id: int,
    amount: int,
    kind: JournalKind,
    idem_key: str,
    packet_id: int | None = None,
) -> bool:
    """Append one journal row and apply it to the balance, inside ``tx``.

    Returns ``True`` when this call posted it: now, or in a run of the same ``Database.run`` whose
    COMMIT answer was lost (the row carries the call's ``tx.token``). Returns ``False`` and changes
    nothing when another call posted ``idem_key`` before with the same account and amount (a replay).
    Raises ``Conflict(insufficient_funds)`` if a debit would take the balance below zero, and
    ``Conflict(idempotency_key_reused)`` if the key was posted with other content; either way the caller's
    transaction must roll back, which undoes the journal row.
    """
    ts = now_ms()
    try:
        await _append(tx, [Posting(account_id, amount, kind, idem_key, packet_id)], ts)
    except IntegrityError:
        prior = await tx.fetchone(
            "SELECT account_id, amount, tx FROM journal WHERE idem_key = %s" + tx.dialect.share_lock,
            (idem_key,),
        )
        if prior is not None and (int(prior[0]), int(prior[1])) == (account_id, amount):
            return tx.resumed and prior[2] is not None and int(prior[2]) == tx.token
        raise Conflict(errors.IDEMPOTENCY_KEY_REUSED, f"{idem_key} was already used") from None
    changed = await tx.execute(
        "UPDATE accounts SET balance = balance + %s, updated_ms = %s"
        " WHERE user_id = %s AND balance + %s >= 0",
        (amount, ts, account_id, amount),
    )
    if changed == 1:
        return True
    exists = await tx.fetchone("SELECT 1 FROM accounts WHERE user_id = %s", (account_id,))
    if exists is None:
        raise NotFound(errors.USER_NOT_FOUND, f"no account for user {account_id}")
    raise Conflict(errors.INSUFFICIENT_FUNDS, "the balance is too low")


async def post_event(
    tx: Tx,
    account_id: int,
    amount: int,
    kind: JournalKind,
    idem_key: str,
    event: events.EventType,
    data: dict[str, object],
    packet_id: int | None = None,
) -> bool:
    """``post``, and when this call posted it, its event (``server.money.events``): the same key, account
    and amount, in the same transaction — every balance change the backend is told of goes through here
    (the batch credits write both in bulk: ``post_many``)."""
    if not await post(tx, account_id, amount, kind, idem_key, packet_id):
        return False
    await events.record(tx, event, idem_key, account_id, amount, data, now_ms())
    return True


# The key of a packet's refund is this and its id: one a packet, whichever path (one primary, a shard, a
# void) pays it; SQL that looks for refunds builds it from this prefix too.
REFUND_PREFIX = "refund:"


def refund_key(packet_id: int) -> str:
    return f"{REFUND_PREFIX}{packet_id}"


async def post_refund(tx: Tx, *, packet_id: int, group_id: int, sender_id: int, amount: int) -> bool:
    """What is left of a packet back to its sender, with its ``packet.refunded`` event; False when this
    packet's refund was posted before."""
    data: dict[str, object] = {
        "packet_id": packet_id,
        "group_id": group_id,
        "sender_id": sender_id,
        "amount": amount,
    }
    key = refund_key(packet_id)
    return await post_event(tx, sender_id, amount, "refund", key, "packet.refunded", data, packet_id)


async def post_many(tx: Tx, credits: Sequence[Posting], ts: int) -> None:
    """Append the grab credits ``credits`` (money in: every amount positive, every key new — the caller
    decided that under its locks), add them to their balances, and write their ``share.credited`` events
    as one row (``events.record_credits``): one insert, one update, one event row, once per transaction
    (all on the shard of the first account: a sharded ledger's caller posts one shard's users). A key met
    again raises ``IntegrityError`` and the caller's transaction rolls back."""
    if any(p.amount <= 0 or p.kind != "grab" for p in credits):
        raise ValueError("post_many pays grabs: any other change goes through post, one at a time")
    if not credits:
        return
    await _append(tx, credits, ts)
    sums: dict[int, int] = defaultdict(int)
    for p in credits:
        sums[p.account_id] += p.amount
    await add_to_balances(tx, dict(sums), ts)
    # After the accounts' locks: a user's events are numbered in the order the user's changes commit.
    await events.record_credits(tx, len(credits), sum(sums.values()), ts, credits[0].account_id)


async def set_packet(tx: Tx, account_id: int, row_id: int, packet_id: int) -> None:
    """Name the packet of journal row ``row_id`` (a sharded send's debit, whose id becomes its packet's:
    ``server.money.shardsteps.debit_send``). The one change a journal row ever takes."""
    await tx.execute(
        "UPDATE journal SET packet_id = %s WHERE account_id = %s AND id = %s", (packet_id, account_id, row_id)
    )


def marks(n: int) -> str:
    return ", ".join(["%s"] * n)


async def add_to_balances(tx: Tx, amounts: dict[int, int], ts: int) -> None:
    """One UPDATE for many accounts (a CASE per account), rows locked in user-id order by the engine's
    index scan, so two batches never wait on each other in a cycle."""
    if not amounts:
        return
    users = sorted(amounts)
    cases = " ".join(["WHEN %s THEN %s"] * len(users))
    params: list[int] = [v for u in users for v in (u, amounts[u])]
    changed = await tx.execute(
        f"UPDATE accounts SET balance = balance + CASE user_id {cases} END, updated_ms = %s"
        f" WHERE user_id IN ({marks(len(users))})",
        [*params, ts, *users],
    )
    if changed != len(users):
        raise RedPacketError(errors.USER_NOT_FOUND, "a credited user has no account")


class JournalEntry(TypedDict):
    id: int
    amount: int
    kind: str
    key: str
    packet_id: int | None
    created_ms: int


async def journal_page(db: Database, user_id: UserId, *, after: int, limit: int) -> list[JournalEntry]:
    """An account's journal rows after row ``after``, oldest first, at most ``limit``."""
    rows = await db.fetchall(
        "SELECT id, amount, kind, idem_key, packet_id, created_ms FROM journal"
        " WHERE account_id = %s AND id > %s ORDER BY id LIMIT %s",
        (user_id, after, limit),
    )
    return [
        JournalEntry(
            id=int(r[0]),
            amount=int(r[1]),
            kind=str(r[2]),
            key=as_text(r[3]),
            packet_id=None if r[4] is None else int(r[4]),
            created_ms=int(r[5]),
        )
        for r in rows
    ]


async def journal_sum(db: Database, user_id: UserId) -> int:
    row = await db.fetchone("SELECT COALESCE(SUM(amount), 0) FROM journal WHERE account_id = %s", (user_id,))
    return int(row[0]) if row else 0
