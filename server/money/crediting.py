"""Batched crediting: many grabs paid in one transaction, exactly once.

The same rules as ``ledger.credit_grab`` (the share must be the one the database pre-split, one share
per user, one user per share, nothing on a refunded packet), decided for a whole batch from three reads,
then written as multi-row inserts and one balance update per account, accounts in a fixed order so two
batches never deadlock. If another worker credited one of these grabs in the meantime the batch rolls
back on the unique keys and falls back to crediting one by one; either way each grab is paid once.
"""

from __future__ import annotations

from collections import defaultdict

from server import errors
from server.errors import RedPacketError
from server.money.ledger import Credit, credit_grab, finish_paid, now_ms
from server.store.db import Database, IntegrityError, Tx

Outcome = str  # "credited", "already", or the error code that refused it


async def credit_many(db: Database, credits: list[Credit]) -> list[Outcome]:
    """Credit every grab in ``credits``; one outcome per credit, in order.

    Cancelled before the commit: nothing is written and every grab can be credited again later.
    """
    if not credits:
        return []
    try:
        return await db.run(lambda tx: _batch(tx, credits))
    except IntegrityError:
        out: list[Outcome] = []
        for c in credits:
            try:
                out.append(await credit_grab(db, c))
            except RedPacketError as e:
                out.append(e.code)
        return out


def _marks(n: int) -> str:
    return ", ".join(["%s"] * n)


async def _batch(tx: Tx, credits: list[Credit]) -> list[Outcome]:
    pids = sorted({c.packet_id for c in credits})
    lock = tx.dialect.share_lock
    # Exclusive, in id order: this batch may finish these packets, and two batches lock them in one order.
    status = {
        int(r[0]): str(r[1])
        for r in await tx.fetchall(
            f"SELECT id, status FROM red_packets WHERE id IN ({_marks(len(pids))}){tx.dialect.for_update}",
            pids,
        )
    }
    # Only the rows this batch is about: its shares, and grab records holding its shares or its users.
    # (Plain IN lists, which the engines search fast; pairs are matched exactly below.)
    seq_pairs = {(c.packet_id, c.seq) for c in credits}
    user_pairs = {(c.packet_id, c.user_id) for c in credits}
    seqs = sorted({c.seq for c in credits})
    users = sorted({c.user_id for c in credits})
    share_rows = await tx.fetchall(
        f"SELECT packet_id, seq, amount FROM red_packet_shares"
        f" WHERE packet_id IN ({_marks(len(pids))}) AND seq IN ({_marks(len(seqs))})",
        [*pids, *seqs],
    )
    shares = {(int(r[0]), int(r[1])): int(r[2]) for r in share_rows if (int(r[0]), int(r[1])) in seq_pairs}
    by_seq: dict[tuple[int, int], tuple[int, str]] = {}
    by_user: dict[tuple[int, int], int] = {}
    held = await tx.fetchall(
        f"SELECT packet_id, user_id, seq, status FROM grab_records WHERE packet_id IN ({_marks(len(pids))})"
        f" AND (seq IN ({_marks(len(seqs))}) OR user_id IN ({_marks(len(users))}))" + lock,
        [*pids, *seqs, *users],
    )
    for pid, uid, seq, st in held:
        if (int(pid), int(seq)) in seq_pairs or (int(pid), int(uid)) in user_pairs:
            by_seq[(int(pid), int(seq))] = (int(uid), str(st))
            by_user[(int(pid), int(uid))] = int(seq)

    out: list[Outcome] = []
    inserts: list[Credit] = []
    updates: list[Credit] = []
    for c in credits:
        seq_key, user_key = (c.packet_id, c.seq), (c.packet_id, c.user_id)
        if c.packet_id not in status:
            out.append(errors.PACKET_NOT_FOUND)
        elif shares.get(seq_key) != c.amount:
            out.append(errors.SHARE_CONFLICT)
        elif seq_key in by_seq:
            holder, st = by_seq[seq_key]
            if holder != c.user_id:
                out.append(errors.SHARE_CONFLICT)
            elif st == "credited":
                out.append("already")
            elif status[c.packet_id] == "refunded":
                out.append(errors.PACKET_EXPIRED)
            else:
                updates.append(c)
                by_seq[seq_key] = (c.user_id, "credited")
                out.append("credited")
        elif user_key in by_user:
            out.append(errors.SHARE_CONFLICT)
        elif status[c.packet_id] == "refunded":
            out.append(errors.PACKET_EXPIRED)
        else:
            inserts.append(c)
            by_seq[seq_key] = (c.user_id, "credited")
            by_user[user_key] = c.seq
            out.append("credited")

    ts = now_ms()
    await tx.executemany(
        "INSERT INTO grab_records (packet_id, user_id, seq, amount, status, grabbed_ms, credited_ms)"
        " VALUES (%s, %s, %s, %s, %s, %s, %s)",
        [(c.packet_id, c.user_id, c.seq, c.amount, "credited", c.grabbed_ms, ts) for c in inserts],
    )
    for c in updates:
        await tx.execute(
            "UPDATE grab_records SET status = 'credited', credited_ms = %s WHERE packet_id = %s AND seq = %s",
            (ts, c.packet_id, c.seq),
        )
    paid = inserts + updates
    await tx.executemany(
        "INSERT INTO journal (account_id, amount, kind, idem_key, packet_id, created_ms)"
        " VALUES (%s, %s, %s, %s, %s, %s)",
        [(c.user_id, c.amount, "grab", f"grab:{c.packet_id}:{c.seq}", c.packet_id, ts) for c in paid],
    )
    per_account: dict[int, int] = defaultdict(int)
    for c in paid:
        per_account[c.user_id] += c.amount
    await add_to_balances(tx, dict(per_account), ts)
    await finish_paid(tx, [c.packet_id for c in paid])
    return out


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
        f" WHERE user_id IN ({_marks(len(users))})",
        [*params, ts, *users],
    )
    if changed != len(users):
        raise RedPacketError(errors.USER_NOT_FOUND, "a credited user has no account")
