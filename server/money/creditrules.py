"""Every rule of a credit, in one place: a grab paid one at a time, in a batch (the fast path included) or
in the shard-local steps (``server.money.crediting``, ``server.money.shardsteps``) is decided here, and
only here. The rules (``decide``, pure): the packet must exist and its refund not be decided (its status
for a credit: ``lock_packets``); the share must be the one the database pre-split (``read_held``); one
share per user and one user per share; a share already paid is ``already`` (or ``credited`` to the call
that paid it before a lost COMMIT answer); a record a shard-local credit left half-way is paid whatever
the packet's status; a grab's journal key already posted is a credit paid before, or, to anyone else, not
this credit's (``against_journal``). Also here: the refusal codes, the record of a refusal, and the reads
a decision needs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal, assert_never

from server import errors
from server.errors import Conflict, NotFound, RedPacketError
from server.money.journal import marks, now_ms
from server.money.ledger import CreditOutcome, grab_key
from server.money.statuses import PacketStatus, RecordStatus
from server.store.db import Tx, as_text
from server.store.records import CreditEntry


class Refusal(StrEnum):
    """Why the ledger will never pay a credit (its code: ``credit_refusals.code``). Any other error is
    worth another try."""

    SHARE_CONFLICT = errors.SHARE_CONFLICT
    PACKET_EXPIRED = errors.PACKET_EXPIRED
    PACKET_NOT_FOUND = errors.PACKET_NOT_FOUND
    USER_NOT_FOUND = errors.USER_NOT_FOUND
    IDEMPOTENCY_KEY_REUSED = errors.IDEMPOTENCY_KEY_REUSED


# The outcome of a credit whose shard of the ledger could not be reached this time (``credit_many(...,
# partial=True)`` on a sharded ledger): nothing final was decided; its outbox entry is to be paid later.
Later = Literal["later"]
LATER: Later = "later"

# What became of one credit, a closed type every caller handles exhaustively (``match`` + ``assert_never``):
# paid now (``credited``) or before (``already``: ``ledger.CreditOutcome``), not decided (``later``), or
# refused for good (a ``Refusal``, recorded in ``credit_refusals`` by the transaction that decided it).
Outcome = CreditOutcome | Later | Refusal
REFUSALS = frozenset(Refusal)

# Who refused a grab: the credit drain, a settlement (refund, sweeper), or a repair that dropped it.
RefusedBy = Literal["drain", "settle", "repair"]


def refusal_of(code: str) -> Refusal | None:
    """The ``Refusal`` an error's code is, or None: the error is worth another try."""
    return Refusal(code) if code in REFUSALS else None


def refused(credits: list[CreditEntry], outcomes: list[Outcome]) -> list[tuple[CreditEntry, Refusal]]:
    """The credits ``outcomes`` refuse, each with its refusal."""
    return [(c, o) for c, o in zip(credits, outcomes, strict=True) if isinstance(o, Refusal)]


def refusal_error(code: Refusal, c: CreditEntry) -> RedPacketError:
    """The error a refusal is to a caller that pays one grab and raises (``crediting.credit_grab``)."""
    match code:
        case Refusal.PACKET_NOT_FOUND | Refusal.USER_NOT_FOUND:
            return NotFound(code, f"{code.replace('_', ' ')}: packet {c.packet_id}, user {c.user_id}")
        case Refusal.SHARE_CONFLICT:
            return Conflict(code, f"share {c.seq} of packet {c.packet_id} is not {c.amount} to this user")
        case Refusal.PACKET_EXPIRED:
            return Conflict(code, f"packet {c.packet_id} was refunded before this credit")
        case Refusal.IDEMPOTENCY_KEY_REUSED:
            return Conflict(code, f"the key of share {c.seq} of packet {c.packet_id} was used otherwise")
        case _:
            assert_never(code)


async def record_refusals(
    tx: Tx, refused: list[tuple[CreditEntry, Refusal]], refused_by: RefusedBy | None
) -> None:
    """Keep each (credit, code) in ``credit_refusals``, in the caller's transaction; a grab already
    recorded keeps its first record. ``refused_by`` None: the caller raises instead (and records
    nothing)."""
    if refused_by is None:
        return
    # One row a grab: a copy of a credit in its batch is refused with it (a statement that met its own
    # key twice warns, and warnings are errors here).
    refused = list({(c.packet_id, c.user_id, c.seq): (c, code) for c, code in refused}.values())
    ts = now_ms()
    await tx.executemany(
        f"{tx.dialect.insert_ignore} INTO credit_refusals"
        " (packet_id, user_id, seq, amount, grabbed_ms, code, refused_by, refused_ms)"
        " VALUES (%s, %s, %s, %s, %s, %s, %s, %s)",
        [
            (c.packet_id, c.user_id, c.seq, c.amount, c.grabbed_ms, str(code), refused_by, ts)
            for c, code in refused
        ],
    )


async def lock_packets(tx: Tx, pids: Sequence[int]) -> dict[int, PacketStatus]:
    """The packets' rows locked (exclusive: a credit may finish its packet, and a shared lock upgraded
    later deadlocks), in id order (two batches lock them in one order); each one's status for a credit:
    ``refunded`` from the moment its refund is decided (``finished_ms`` set on a ``refunding`` packet: the
    sharded refund's first step; on one database the refund sets both at once)."""
    rows = await tx.fetchall(
        f"SELECT id, status, finished_ms FROM red_packets WHERE id IN ({marks(len(pids))}) ORDER BY id"
        + tx.dialect.for_update,
        list(pids),
    )
    return {
        int(r[0]): PacketStatus.REFUNDED
        if r[1] == PacketStatus.REFUNDING and r[2] is not None
        else PacketStatus(r[1])
        for r in rows
    }


@dataclass
class Held:
    """What the database holds about a batch's credits: the shares it pre-split, and the grab records
    holding their shares or their users (``read_held``)."""

    shares: dict[tuple[int, int], int] = field(default_factory=dict)  # (packet, seq) → amount
    by_seq: dict[tuple[int, int], tuple[int, RecordStatus]] = field(default_factory=dict)  # → (user, status)
    by_user: dict[tuple[int, int], int] = field(default_factory=dict)  # (packet, user) → seq


async def read_held(tx: Tx, credits: list[CreditEntry]) -> Held:
    """The shares and grab records ``credits`` are decided on (records read with shared locks)."""
    pids = sorted({c.packet_id for c in credits})
    # Only the rows this batch is about: its shares, and grab records holding its shares or its users.
    # (Plain IN lists, which the engines search fast; pairs are matched exactly below.)
    seq_pairs = {(c.packet_id, c.seq) for c in credits}
    user_pairs = {(c.packet_id, c.user_id) for c in credits}
    seqs = sorted({c.seq for c in credits})
    users = sorted({c.user_id for c in credits})
    share_rows = await tx.fetchall(
        f"SELECT packet_id, seq, amount FROM red_packet_shares"
        f" WHERE packet_id IN ({marks(len(pids))}) AND seq IN ({marks(len(seqs))})",
        [*pids, *seqs],
    )
    held = Held()
    held.shares = {
        (int(r[0]), int(r[1])): int(r[2]) for r in share_rows if (int(r[0]), int(r[1])) in seq_pairs
    }
    rows = await tx.fetchall(
        f"SELECT packet_id, user_id, seq, status FROM grab_records WHERE packet_id IN ({marks(len(pids))})"
        f" AND (seq IN ({marks(len(seqs))}) OR user_id IN ({marks(len(users))}))" + tx.dialect.share_lock,
        [*pids, *seqs, *users],
    )
    for pid, uid, seq, st in rows:
        if (int(pid), int(seq)) in seq_pairs or (int(pid), int(uid)) in user_pairs:
            held.by_seq[(int(pid), int(seq))] = (int(uid), RecordStatus(st))
            held.by_user[(int(pid), int(uid))] = int(seq)
    return held


async def read_posted(tx: Tx, credits: list[CreditEntry]) -> dict[tuple[int, int], tuple[int, int]]:
    """The journal rows already under the grab keys of ``credits`` (``ledger.grab_key``): (packet, seq) →
    (account, amount). On one database a grab's row and its record commit together, so one found for a
    credit ``decide`` would pay means the key was taken some other way."""
    if not credits:
        return {}
    keys = {grab_key(c.packet_id, c.seq): (c.packet_id, c.seq) for c in credits}
    rows = await tx.fetchall(
        f"SELECT idem_key, account_id, amount FROM journal WHERE idem_key IN ({marks(len(keys))})", list(keys)
    )
    return {keys[as_text(r[0])]: (int(r[1]), int(r[2])) for r in rows}


def against_journal(
    credits: list[CreditEntry],
    out: list[Outcome],
    pay: list[CreditEntry],
    posted: dict[tuple[int, int], tuple[int, int]],
) -> tuple[list[Outcome], set[tuple[int, int]], set[tuple[int, int]]]:
    """The rule of a grab's journal key, for the credits ``decide`` would pay (``pay``): its key already
    posted to this user for this amount is a credit paid before (``already``: its record is written, it is
    not posted again); posted to another account or amount, the key is not this credit's to use
    (``idempotency_key_reused``, refused and recorded). Returns the outcomes and the (packet, seq) of each
    kind. Pure."""
    there: set[tuple[int, int]] = {
        (c.packet_id, c.seq) for c in pay if posted.get((c.packet_id, c.seq)) == (c.user_id, c.amount)
    }
    met: set[tuple[int, int]] = {(c.packet_id, c.seq) for c in pay if (c.packet_id, c.seq) in posted}
    taken = met - there
    changed: list[Outcome] = []
    for c, o in zip(credits, out, strict=True):
        k = (c.packet_id, c.seq)
        if o in ("credited", "already") and k in taken:  # (a copy of it in the batch is refused too)
            changed.append(Refusal.IDEMPOTENCY_KEY_REUSED)
        elif o == "credited" and k in there:
            changed.append("already")
        else:
            changed.append(o)
    return changed, there, taken


def decide(
    credits: list[CreditEntry],
    status: dict[int, PacketStatus],
    held: Held,
    mine: set[tuple[int, int]],
    users: set[int] | None = None,
) -> tuple[list[Outcome], list[CreditEntry], list[CreditEntry]]:
    """Each credit's outcome, and the credits to pay: those with no grab record yet (to insert) and those
    whose record is there and not yet paid (to update). Pure.

    ``status``: each packet's (a packet whose refund is decided counts as ``refunded``); ``mine``: (packet,
    seq) this very call paid in a run whose COMMIT answer was lost; ``users``: the users known to exist,
    when the decision must check (the shard-local steps: an account is made on the user's shard later).
    A record ``crediting`` (a shard-local credit that stopped half-way) is paid whatever the packet's
    status: its packet's shard decided it, and a refund counted it as paid."""
    out: list[Outcome] = []
    inserts: list[CreditEntry] = []
    updates: list[CreditEntry] = []
    by_seq, by_user = dict(held.by_seq), dict(held.by_user)
    for c in credits:
        seq_key, user_key = (c.packet_id, c.seq), (c.packet_id, c.user_id)
        if c.packet_id not in status:
            out.append(Refusal.PACKET_NOT_FOUND)
        elif held.shares.get(seq_key) != c.amount:
            out.append(Refusal.SHARE_CONFLICT)
        elif seq_key in by_seq:
            holder, st = by_seq[seq_key]
            if holder != c.user_id:
                out.append(Refusal.SHARE_CONFLICT)
            elif st is RecordStatus.CREDITED:
                out.append("credited" if seq_key in mine else "already")
            elif st is not RecordStatus.CREDITING and status[c.packet_id] is PacketStatus.REFUNDED:
                out.append(Refusal.PACKET_EXPIRED)
            else:
                updates.append(c)
                by_seq[seq_key] = (c.user_id, RecordStatus.CREDITED)
                out.append("credited")
        elif user_key in by_user:
            out.append(Refusal.SHARE_CONFLICT)
        elif status[c.packet_id] is PacketStatus.REFUNDED:
            out.append(Refusal.PACKET_EXPIRED)
        elif users is not None and c.user_id not in users:
            out.append(Refusal.USER_NOT_FOUND)
        else:
            inserts.append(c)
            by_seq[seq_key] = (c.user_id, RecordStatus.CREDITED)
            by_user[user_key] = c.seq
            out.append("credited")
    return out, inserts, updates
