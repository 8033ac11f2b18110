"""The ledger: users and their names, accounts and their balances, top-ups, and the credit of one grab.

Every balance change is a journal row written by ``server.money.journal`` (``post``, ``post_many``): one
row with a unique idempotency key and the matching balance update, in the caller's transaction.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, overload

from server import errors, text
from server.errors import Conflict, InvalidRequest, NotFound
from server.ids import PacketId, UserId
from server.money import events
from server.money.accounts import claim_request, ensure_accounts, open_accounts
from server.money.events import grab_key as grab_key  # (the journal key's format lives with its reader)
from server.money.journal import marks, post_event
from server.money.journal import now_ms as now_ms  # (the ledger's clock, as every caller imports it)
from server.money.statuses import PacketStatus, RecordStatus
from server.store.db import Database, IntegrityError, Tx

# A demo top-up is play money; this only keeps a typo from minting a fortune.
MAX_TOPUP_CENTS = 100_000_000
# A client's request id (an idempotency key), in characters.
MAX_REQUEST_ID_CHARS = 64


def check_cents(amount: object, what: str) -> int:
    """An amount of money in a request: whole cents, 1 to ``MAX_TOPUP_CENTS``, else ``amount_invalid``."""
    if not isinstance(amount, int) or isinstance(amount, bool) or not 0 < amount <= MAX_TOPUP_CENTS:
        raise InvalidRequest(errors.AMOUNT_INVALID, f"{what} is 1 to {MAX_TOPUP_CENTS} cents")
    return amount


def check_request_id(request_id: object, what: str = "a request_id") -> str:
    """A client's idempotency key: a string of 1 to 64 characters, with no control or invisible characters
    and no whitespace at either end (``server.text.request_id_ok``). Keys compare byte for byte."""
    if not isinstance(request_id, str) or not 0 < len(request_id) <= MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(
            errors.BAD_REQUEST, f"{what} is a string of 1 to {MAX_REQUEST_ID_CHARS} characters"
        )
    if not text.request_id_ok(request_id):
        raise InvalidRequest(
            errors.BAD_REQUEST,
            f"{what} may not hold control or invisible characters, nor start or end with whitespace",
        )
    return request_id


def check_name(name: object) -> str:
    """A user or group name, stripped: 1 to 64 characters, printable (``server.text.name_ok``)."""
    if not isinstance(name, str) or not name.strip() or len(name.strip()) > 64:
        raise InvalidRequest(errors.NAME_INVALID, "a name is 1 to 64 characters")
    if not text.name_ok(name.strip()):
        raise InvalidRequest(
            errors.NAME_INVALID, "a name may not hold control characters or invisible formatting"
        )
    return name.strip()


async def create_user(db: Database, name: str) -> UserId:
    """A new user with an empty account."""
    name = check_name(name)

    async def work(tx: Tx) -> UserId:
        ts = now_ms()
        try:
            await tx.execute(
                "INSERT INTO users (name, created_ms, origin) VALUES (%s, %s, 'hub')", (name, ts)
            )
        except IntegrityError:
            raise Conflict(errors.NAME_TAKEN, f"{name} is taken") from None
        if tx.lastrowid is None:
            raise RuntimeError("the database returned no id for the new user")
        user_id = UserId(tx.lastrowid)
        if not db.shards:  # (sharded: on the user's shard, apart)
            await tx.execute(
                "INSERT INTO accounts (user_id, balance, updated_ms) VALUES (%s, 0, %s)", (user_id, ts)
            )
        return user_id

    made = await db.run(work, idempotent=False)
    await open_accounts(db, [made] if db.shards else [])
    return made


async def put_user(db: Database, user_id: UserId, name: object) -> Literal["created", "renamed", "unchanged"]:
    """Create user ``user_id`` (with an empty account) or rename it: the chat backend's own ids.
    Idempotent; a name another user holds is ``name_taken``, an id the hub gave a user of its own
    (dev login) ``id_taken``."""
    clean = check_name(name)

    async def work(tx: Tx) -> Literal["created", "renamed", "unchanged"]:
        row = await tx.fetchone(
            "SELECT name, origin FROM users WHERE id = %s" + tx.dialect.for_update, (user_id,)
        )
        ts = now_ms()
        if row is not None and row[1] == "hub":
            raise Conflict(
                errors.ID_TAKEN, f"user {user_id} was made on the hub (dev login), not by the backend"
            )
        try:
            if row is None:
                await tx.execute(
                    "INSERT INTO users (id, name, created_ms, origin) VALUES (%s, %s, %s, 'backend')",
                    (user_id, clean, ts),
                )
                if not db.shards:  # (sharded: on the user's shard, apart)
                    await tx.execute(
                        "INSERT INTO accounts (user_id, balance, updated_ms) VALUES (%s, 0, %s)",
                        (user_id, ts),
                    )
                return "created"
            if row[1] != "backend":  # a user from before origins were kept: the backend's from now on
                await tx.execute("UPDATE users SET origin = 'backend' WHERE id = %s", (user_id,))
            if row[0] == clean:
                return "unchanged"
            await tx.execute("UPDATE users SET name = %s WHERE id = %s", (clean, user_id))
            return "renamed"
        except IntegrityError:
            taken = await tx.fetchone("SELECT id FROM users WHERE name = %s", (clean,))
            if taken is not None and int(taken[0]) != user_id:
                raise Conflict(errors.NAME_TAKEN, f"{clean} is another user's name") from None
            raise  # the same id created concurrently: the caller runs it again and finds it

    try:
        done = await db.run(work, idempotent=True)
    except IntegrityError:
        done = await db.run(work, idempotent=True)
    await open_accounts(db, [user_id] if db.shards else [])
    return done


async def create_users(db: Database, names: list[str]) -> list[UserId]:
    """Many new users with empty accounts in one transaction (imports, benchmarks, tests)."""
    clean = [check_name(n) for n in names]

    async def work(tx: Tx) -> list[UserId]:
        ts = now_ms()
        try:
            await tx.executemany(
                "INSERT INTO users (name, created_ms, origin) VALUES (%s, %s, %s)",  # (one multi-row INSERT)
                [(n, ts, "hub") for n in clean],
            )
        except IntegrityError:
            raise Conflict(errors.NAME_TAKEN, "one of the names is taken") from None
        ids: list[UserId] = []
        for i in range(0, len(clean), 500):
            chunk = clean[i : i + 500]
            rows = await tx.fetchall(f"SELECT name, id FROM users WHERE name IN ({marks(len(chunk))})", chunk)
            by_name = {str(r[0]): UserId(int(r[1])) for r in rows}
            ids += [by_name[n] for n in chunk]
        if not db.shards:  # (sharded: on the users' shards, apart)
            await tx.executemany(
                "INSERT INTO accounts (user_id, balance, updated_ms) VALUES (%s, %s, %s)",
                [(u, 0, ts) for u in ids],
            )
        return ids

    made = await db.run(work, idempotent=False)
    await open_accounts(db, made if db.shards else [])
    return made


async def users_by_name(db: Database, names: list[object]) -> dict[str, UserId]:
    """The ids of the users so named, one query per 500 names (each name checked as a name first)."""
    clean = [check_name(n) for n in names]
    out: dict[str, UserId] = {}
    for i in range(0, len(clean), 500):
        chunk = clean[i : i + 500]
        rows = await db.fetchall(f"SELECT name, id FROM users WHERE name IN ({marks(len(chunk))})", chunk)
        out.update({str(r[0]): UserId(int(r[1])) for r in rows})
    return {n: out[c] for n, c in zip(names, clean, strict=True) if c in out and isinstance(n, str)}


@overload
async def user_by_name(db: Database, name: str) -> UserId | None: ...


@overload
async def user_by_name(db: Database, name: str, with_origin: Literal[True]) -> tuple[UserId, str] | None: ...


async def user_by_name(
    db: Database, name: str, with_origin: bool = False
) -> UserId | tuple[UserId, str] | None:
    """The id of the user called ``name`` (with ``with_origin``: and who made it, ``hub`` or
    ``backend``), or None."""
    row = await db.fetchone("SELECT id, origin FROM users WHERE name = %s", (check_name(name),))
    if row is None:
        return None
    return (UserId(int(row[0])), str(row[1])) if with_origin else UserId(int(row[0]))


async def user_exists(db: Database, user_id: UserId) -> bool:
    """Whether the hub has user ``user_id`` (a valid token may name one it was never given)."""
    return await db.fetchone("SELECT 1 FROM users WHERE id = %s", (user_id,)) is not None


async def balance(db: Database, user_id: UserId) -> int:
    row = await db.fetchone("SELECT balance FROM accounts WHERE user_id = %s", (user_id,))
    if row is None:
        raise NotFound(errors.USER_NOT_FOUND, f"no account for user {user_id}")
    return int(row[0])


async def user_name(db: Database, user_id: UserId) -> str | None:
    row = await db.fetchone("SELECT name FROM users WHERE id = %s", (user_id,))
    return None if row is None else str(row[0])


async def topup(
    db: Database, user_id: UserId, amount: object, request_id: object, service: bool = False
) -> bool:
    """Add money to an account: play money (a demo top-up, keyed per user) or, with ``service``, the chat
    backend's funding from its wallet (keyed by ``request_id`` alone: paid once, whoever asks). Idempotent
    on the key; returns False on a replay."""
    cents = check_cents(amount, "a top-up")
    request_id = check_request_id(request_id, "a top-up's request_id")
    key = f"service-topup:{request_id}" if service else f"topup:{user_id}:{request_id}"
    source = "service" if service else "demo"

    data: dict[str, object] = {
        "user_id": user_id,
        "amount": cents,
        "request_id": request_id,
        "source": source,
    }

    async def work(tx: Tx) -> bool:
        await ensure_accounts(tx, [user_id] if db.shards else [], now_ms())  # (a user made half-way)
        return await post_event(tx, user_id, cents, "topup", key, "account.topup", data)

    await claim_request(db, key, user_id)
    return await db.run(work, idempotent=True)


CreditOutcome = Literal["credited", "already"]


async def finish_paid(tx: Tx, paid: Mapping[PacketId, int]) -> int:
    """``paid``: packet → how many of its grab records this transaction has just marked ``credited`` (0:
    none, only look). Each packet's ``credited_count`` is raised by that, and those whose every share is
    now credited become ``finished``, each with its ``packet.finished`` event, in the caller's transaction
    (the one that credited the last share): ``finished`` means every share is paid, from the moment it is.
    ``finished_ms`` is when the last share was grabbed. Returns how many finished. (The caller holds the
    packets' rows locked.)"""
    ids = sorted(paid)
    if not ids:
        return 0
    for pid in ids:
        if paid[pid]:  # (NULL, on a packet sent before the count was kept, stays NULL)
            await tx.execute(
                "UPDATE red_packets SET credited_count = credited_count + %s WHERE id = %s", (paid[pid], pid)
            )
    # Most batches stop here: no packet full. One sent before its count was kept is counted row by row.
    full = await tx.fetchall(
        "SELECT id, sender_id, group_id, total, share_count FROM red_packets"
        f" WHERE id IN ({marks(len(ids))}) AND status = '{PacketStatus.ACTIVE}' AND"
        " (credited_count >= share_count OR (credited_count IS NULL AND share_count = (SELECT COUNT(*)"
        " FROM grab_records g WHERE g.packet_id = red_packets.id"
        f" AND g.status = '{RecordStatus.CREDITED}')))",
        ids,
    )
    ts = now_ms()
    finished = 0
    for pid, sender, group, total, count in full:
        # Its records, read once: a count that says full (or more) and records that do not (a count gone
        # wrong, which reconciliation reports) never finish a packet with a share unpaid.
        paid_records = await tx.fetchone(
            "SELECT COUNT(*), MAX(grabbed_ms) FROM grab_records"
            f" WHERE packet_id = %s AND status = '{RecordStatus.CREDITED}'",
            (pid,),
        )
        if paid_records is None or int(paid_records[0]) != int(count):
            continue
        if await tx.execute(
            f"UPDATE red_packets SET status = '{PacketStatus.FINISHED}', finished_ms = %s"
            f" WHERE id = %s AND status = '{PacketStatus.ACTIVE}'",
            (int(paid_records[1]), pid),
        ):
            await finished_event(tx, PacketId(int(pid)), int(sender), int(group), int(total), int(count), ts)
            finished += 1
    return finished


async def recount_paid(tx: Tx, packet_ids: list[PacketId]) -> list[PacketId]:
    """Each packet's ``credited_count`` set from its grab records where it is not their count (credits
    paid by a process from before migration 14, still running when it was applied, raised none); returns
    the packets set. (The caller holds the packets' rows locked.)"""
    ids = sorted(set(packet_ids))
    if not ids:
        return []
    records = await tx.fetchall(
        f"SELECT packet_id, COUNT(*) FROM grab_records WHERE packet_id IN ({marks(len(ids))})"
        f" AND status = '{RecordStatus.CREDITED}' GROUP BY packet_id",
        ids,
    )
    paid = {int(pid): int(n) for pid, n in records}
    fixed = []
    rows = await tx.fetchall(
        f"SELECT id, credited_count FROM red_packets WHERE id IN ({marks(len(ids))})", ids
    )
    for pid, kept in rows:
        n = paid.get(int(pid), 0)
        if kept is None or int(kept) != n:
            await tx.execute("UPDATE red_packets SET credited_count = %s WHERE id = %s", (n, pid))
            fixed.append(PacketId(int(pid)))
    return fixed


async def finished_event(
    tx: Tx, packet_id: PacketId, sender: int, group: int, total: int, count: int, ts: int
) -> None:
    data = {"packet_id": packet_id, "group_id": group, "sender_id": sender, "total": total, "count": count}
    await events.record(tx, "packet.finished", finished_key(packet_id), sender, None, data, ts, packet_id)


def finished_key(packet_id: int) -> str:
    """The key of a packet's ``packet.finished`` event."""
    return f"finished:{packet_id}"


async def posted_by_this_call(tx: Tx, idem_key: str) -> bool:
    """Whether this ``Database.run`` call posted ``idem_key`` in an earlier run whose COMMIT answer was
    lost (its journal row carries the call's token)."""
    if not tx.resumed:
        return False
    row = await tx.fetchone("SELECT tx FROM journal WHERE idem_key = %s", (idem_key,))
    return row is not None and row[0] is not None and int(row[0]) == tx.token
