"""Accounts and request keys on a sharded ledger (``server.store.shards``).

On one database a user and its account are inserted in one transaction; on a sharded ledger the user is a
row of the head and the account a row of the user's shard, so they are made in two (``open_accounts``
after the user's), and a process that died in between leaves a user with no account: whatever pays the
user first makes it (``ensure_accounts``).

A journal key is unique within a shard. A key that must name one user's request whoever asks (the chat
backend's top-up, withdrawal or hold ids) is first claimed for its user on the head (``claim_request``):
the same id for another user is refused there, as the journal's key refuses it on one database."""

from __future__ import annotations

import time
from collections.abc import Sequence

from server import errors
from server.errors import Conflict
from server.store.db import Database, IntegrityError, Tx
from server.store.shards import by_shard


def _marks(n: int) -> str:
    return ", ".join(["%s"] * n)


async def ensure_accounts(tx: Tx, users: Sequence[int], ts: int) -> None:
    """Lock these users' accounts in id order, first making an empty one for each user who exists and
    has none (a user that does not exist gets none)."""
    if not users:
        return
    ids = sorted(set(users))
    have = await tx.fetchall(
        f"SELECT user_id FROM accounts WHERE user_id IN ({_marks(len(ids))}) ORDER BY user_id"
        + tx.dialect.for_update,
        ids,
    )
    missing = sorted(set(ids) - {int(r[0]) for r in have})
    if missing:
        await tx.execute(
            f"{tx.dialect.insert_ignore} INTO accounts (user_id, balance, updated_ms)"
            f" SELECT id, 0, %s FROM users WHERE id IN ({_marks(len(missing))})",
            [ts, *missing],
        )


async def open_accounts(db: Database, users: Sequence[int]) -> None:
    """The accounts of users just made on a sharded ledger: one transaction per user shard."""
    for group in by_shard(list(users), db.shards).values():
        await db.run(lambda tx, g=group: ensure_accounts(tx, g, int(time.time() * 1000)), idempotent=True)  # type: ignore[misc]


async def claim_request(db: Database, key: str, user_id: int) -> None:
    """On a sharded ledger, claim ``key`` for ``user_id`` on the head before the user's shard posts it;
    ``idempotency_key_reused`` when another user holds it. Nothing to do on one database."""
    if not db.shards:
        return

    async def work(tx: Tx) -> None:
        try:
            await tx.execute(
                "INSERT INTO request_claims (idem_key, user_id, created_ms) VALUES (%s, %s, %s)",
                (key, user_id, int(time.time() * 1000)),
            )
        except IntegrityError:
            row = await tx.fetchone("SELECT user_id FROM request_claims WHERE idem_key = %s", (key,))
            if row is None or int(row[0]) != user_id:
                raise Conflict(errors.IDEMPOTENCY_KEY_REUSED, f"{key} was already used") from None

    await db.run(work, idempotent=True)
