"""Money moves on a sharded ledger (``server.store.shards``): each a chain of transactions that write rows
of one shard each, every step keyed so that running it again finds its own work and does nothing more.
Nothing relies on a transaction that writes two shards (Spider's XA is off; on Vitess this is the
``single`` transaction mode), so a process killed between two steps leaves work that the next run of the
same money move — by any worker — completes.

**A credit** (``credit_many``) is three steps, by the key ``grab:<packet>:<seq>``:

1. packet shard: the decision (``creditrules.decide``, under the packet's row lock): the grab record
   written ``crediting`` — from now on this user has this share — or the credit refused and recorded;
2. user shard: the journal row and the balance, and the ``share.credited`` event, unless the key is
   there already;
3. packet shard: the record ``credited``, and the packet ``finished`` when it was the last share.

The drain acknowledges an outbox entry only after step 3, so a worker that died half-way leaves the entry
to the next; the sweeper also completes records left ``crediting`` (``complete_stranded``).

**A refund** (``refund``): packet shard: the refund decided (``finished_ms`` set on the ``refunding``
packet: no new grab record from now on; what is left is the total less every record ``crediting`` or
``credited``); sender's shard: ``refund:<packet>`` posted; packet shard: ``refunded`` (or ``finished``).

**A send** (``debit_send``, ``create_packet``): the sender's shard debits by the send's request id
(``send:<sender>:<request id>``); the debit's journal id is the packet's id. Then the packet's shard
creates the packet and its shares with that id. A debit whose packet was never made (the sender's process
died in between and the client did not retry within ``UNSENT_MS``) is refunded by ``void_unsent``: it
first writes a ``void`` packet row with that id, so the packet's own primary key decides between a late
creation and the refund — never both. A packet exists only after its debit, so only a debited packet is
ever loaded into Redis.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Literal, TypeVar

from server import errors
from server.errors import Conflict
from server.ids import PacketId
from server.money import events
from server.money.accounts import ensure_accounts
from server.money.creditrules import (
    LATER,
    Outcome,
    RefusedBy,
    decide,
    lock_packets,
    read_held,
    record_refusals,
    refused,
)
from server.money.journal import REFUND_PREFIX, Posting, marks, post, post_many, post_refund, set_packet
from server.money.ledger import finish_paid, finished_event, grab_key, now_ms
from server.money.packetrows import PacketKeyTaken
from server.money.statuses import PacketStatus, RecordStatus
from server.store.db import Database, RetryableError, Tx, as_text
from server.store.records import CreditEntry
from server.store.shards import shard_of

Pair = tuple[int, int]  # (packet, seq)
T = TypeVar("T")


def _groups(
    items: list[CreditEntry], among: Iterable[int], key: Callable[[CreditEntry], int], shards: int
) -> list[list[int]]:
    """The indexes ``among`` of ``items`` grouped by the shard of ``key(item)``, shards in order."""
    groups: dict[int, list[int]] = {}
    for i in among:
        groups.setdefault(shard_of(key(items[i]), shards), []).append(i)
    return [groups[s] for s in sorted(groups)]


async def credit_many(
    db: Database, credits: list[CreditEntry], refused_by: RefusedBy | None, partial: bool = False
) -> list[Outcome]:
    """Credit ``credits`` in the three steps, one transaction per shard and step; one outcome per credit:
    ``credited`` when this call posted it, ``already`` when another had, or the code that refused it
    (recorded in step 1). ``partial``: a shard that cannot be reached now (a backend down) makes its
    credits ``later`` while the others are paid (the drain then acknowledges only those); otherwise, or
    when no credit could be paid, its error is raised."""
    out: list[Outcome] = [LATER] * len(credits)  # (each is decided by step 1, or stays later)
    failed: list[RetryableError] = []

    async def each(idxs: list[int], step: Callable[[Tx, list[CreditEntry]], Awaitable[T]]) -> T | None:
        batch = [credits[i] for i in idxs]
        try:
            return await db.run(lambda tx: step(tx, batch), idempotent=True)
        except RetryableError as e:
            if not partial:
                raise
            failed.append(e)
            for i in idxs:
                out[i] = LATER
            return None

    for idxs in _groups(credits, range(len(credits)), lambda c: c.packet_id, db.shards):
        decided = await each(idxs, lambda tx, b: _claim(tx, b, refused_by))
        for i, o in zip(idxs, decided or [], strict=False):
            out[i] = o
    paying = [i for i, o in enumerate(out) if o == "credited"]
    posted: set[Pair] = set()
    for idxs in _groups(credits, paying, lambda c: c.user_id, db.shards):
        posted |= await each(idxs, _pay) or set()
    for i in paying:
        if out[i] != LATER:
            out[i] = "credited" if (credits[i].packet_id, credits[i].seq) in posted else "already"
    paid = [i for i in paying if out[i] != LATER]  # (never marked paid before its posting is made)
    for idxs in _groups(credits, paid, lambda c: c.packet_id, db.shards):
        await each(idxs, _close)
    if failed and all(o == LATER for o in out):
        raise failed[0]
    return out


async def _claim(tx: Tx, credits: list[CreditEntry], refused_by: RefusedBy | None) -> list[Outcome]:
    """Step 1, on the packets' shard: decide each credit; write the new grab records ``crediting``."""
    status = await lock_packets(tx, sorted({c.packet_id for c in credits}))
    held = await read_held(tx, credits)
    uids = sorted({c.user_id for c in credits})
    users = {
        int(r[0]) for r in await tx.fetchall(f"SELECT id FROM users WHERE id IN ({marks(len(uids))})", uids)
    }
    out, inserts, _ = decide(credits, status, held, set(), users)
    await tx.executemany(
        # (Every value a placeholder: only then does the driver send one multi-row INSERT, not one each.)
        "INSERT INTO grab_records (packet_id, user_id, seq, amount, status, grabbed_ms, credited_ms)"
        " VALUES (%s, %s, %s, %s, %s, %s, %s)",
        [
            (c.packet_id, c.user_id, c.seq, c.amount, RecordStatus.CREDITING, c.grabbed_ms, None)
            for c in inserts
        ],
    )
    await record_refusals(tx, refused(credits, out), refused_by)
    return out


async def _pay(tx: Tx, credits: list[CreditEntry]) -> set[Pair]:
    """Step 2, on the users' shard: post each credit whose key is not there; return the (packet, seq)
    this call posted (now, or in a run whose COMMIT answer was lost)."""
    ts = now_ms()
    uids = sorted({c.user_id for c in credits})
    await ensure_accounts(tx, uids, ts)
    keys = {grab_key(c.packet_id, c.seq): c for c in credits}
    rows = await tx.fetchall(
        f"SELECT idem_key, tx FROM journal WHERE account_id IN ({marks(len(uids))})"
        f" AND idem_key IN ({marks(len(keys))})",
        [*uids, *keys],
    )
    there = {as_text(r[0]): r[1] for r in rows}
    new = [c for k, c in keys.items() if k not in there]
    await post_many(
        tx, [Posting(c.user_id, c.amount, "grab", grab_key(c.packet_id, c.seq), c.packet_id) for c in new], ts
    )
    mine = [keys[k] for k, t in there.items() if tx.resumed and t is not None and int(t) == tx.token]
    return {(c.packet_id, c.seq) for c in [*new, *mine]}


async def _close(tx: Tx, credits: list[CreditEntry]) -> None:
    """Step 3, on the packets' shard: the records ``credited``; the packets they finish ``finished``."""
    pids = sorted({c.packet_id for c in credits})
    await lock_packets(tx, pids)
    ts = now_ms()
    marked: dict[PacketId, int] = {}
    for pid in pids:
        seqs = sorted({c.seq for c in credits if c.packet_id == pid})
        marked[pid] = await tx.execute(  # (0 for a record an earlier run of this step marked)
            f"UPDATE grab_records SET status = '{RecordStatus.CREDITED}', credited_ms = %s"
            f" WHERE packet_id = %s AND seq IN ({marks(len(seqs))}) AND status = '{RecordStatus.CREDITING}'",
            [ts, pid, *seqs],
        )
    await finish_paid(tx, marked)


async def complete_stranded(db: Database, older_than_ms: int, limit: int = 500) -> int:
    """Finish credits left ``crediting`` (their worker died after step 1 and their outbox entry is gone,
    or late): steps 2 and 3 again, from the record alone. Returns how many this call posted."""
    rows = await db.fetchall(
        "SELECT packet_id, user_id, seq, amount, grabbed_ms FROM grab_records"
        f" WHERE status = '{RecordStatus.CREDITING}' AND grabbed_ms < %s ORDER BY packet_id LIMIT %s",
        (older_than_ms, limit),
    )
    stranded = [CreditEntry(*(int(v) for v in r)) for r in rows]  # type: ignore[arg-type]
    if not stranded:
        return 0
    return sum(o == "credited" for o in await credit_many(db, stranded, "settle"))


# What the sharded refund's steps came to: refunded, finished (nothing was left), taken (another run has
# it), waiting (nothing to pay back, but a share still on its way: the next run finishes the packet).
StepsOutcome = Literal["refunded", "finished", "taken", "waiting"]


@dataclass(frozen=True)
class RefundSteps:
    outcome: StepsOutcome
    amount: int = 0


async def refund(db: Database, packet_id: PacketId, now: int) -> RefundSteps:
    """Pay back what nobody took of a ``refunding`` packet whose grabs are all settled: decide on the
    packet's shard, post on the sender's, close on the packet's."""

    async def decide_left(tx: Tx) -> tuple[int, int, int, int, str] | None:
        row = await tx.fetchone(
            "SELECT sender_id, total, status, group_id, share_count FROM red_packets WHERE id = %s"
            + tx.dialect.for_update,
            (packet_id,),
        )
        if row is None or row[2] != PacketStatus.REFUNDING:
            return None
        await tx.execute(
            "UPDATE red_packets SET finished_ms = %s WHERE id = %s AND finished_ms IS NULL", (now, packet_id)
        )
        paid = await tx.fetchone(
            "SELECT COALESCE(SUM(amount), 0) FROM grab_records WHERE packet_id = %s"
            f" AND status IN ('{RecordStatus.CREDITING}', '{RecordStatus.CREDITED}')",
            (packet_id,),
        )
        left = int(row[1]) - int(paid[0] if paid else 0)
        if left < 0:
            raise RuntimeError(f"packet {packet_id} paid out more than its total")
        return (
            int(row[0]),
            left,
            int(row[3]),
            int(row[4]),
            PacketStatus.REFUNDED if left else PacketStatus.FINISHED,
        )

    decided = await db.run(decide_left, idempotent=True)
    if decided is None:
        return RefundSteps("taken")
    sender, left, group, count, status = decided
    posted = False
    if left:

        async def pay(tx: Tx) -> bool:
            return await post_refund(tx, packet_id=packet_id, group_id=group, sender_id=sender, amount=left)

        posted = await db.run(pay, idempotent=True)

    async def close(tx: Tx) -> bool | None:
        row = await tx.fetchone(
            f"SELECT total FROM red_packets WHERE id = %s AND status = '{PacketStatus.REFUNDING}'"
            + tx.dialect.for_update,
            (packet_id,),
        )
        if row is None:
            return False  # closed by another run
        if status is PacketStatus.FINISHED and await tx.fetchone(
            f"SELECT 1 FROM grab_records WHERE packet_id = %s AND status = '{RecordStatus.CREDITING}'",
            (packet_id,),
        ):
            # Nothing to pay back, but a share is still on its way (its record crediting): "finished"
            # and its event wait until it is paid; the next run of the refund finishes the packet.
            return None
        await tx.execute("UPDATE red_packets SET status = %s WHERE id = %s", (status, packet_id))
        if status is PacketStatus.FINISHED:
            await finished_event(tx, packet_id, sender, group, int(row[0]), count, now_ms())
        return True

    closed = await db.run(close, idempotent=True)
    if closed is None:
        return RefundSteps("waiting")
    return RefundSteps(("refunded" if left else "finished") if closed or posted else "taken", left)


async def debit_send(
    db: Database,
    sender_id: int,
    key: str,
    total: int,
    check: Callable[[Tx], Awaitable[None]],
    event: Callable[[int], dict[str, object]],
) -> PacketId:
    """Step 1 of a send, on the sender's shard: ``check`` (may the sender send), then the debit keyed
    ``key``, its row's id the packet's, and the ``packet.sent`` event (``event(packet_id)``, its data).
    Returns the packet id (the debit's, whichever call of the request made it)."""

    async def work(tx: Tx) -> PacketId:
        await check(tx)
        find = "SELECT id, amount, tx FROM journal WHERE account_id = %s AND idem_key = %s"
        before = await tx.fetchone(find, (sender_id, key))
        if before is not None:
            if int(before[1]) != -total:
                raise Conflict(errors.IDEMPOTENCY_KEY_REUSED, f"{key} was already used for another send")
            return PacketId(int(before[0]))
        posted = await post(tx, sender_id, -total, "send", key)  # False: the same request committed meanwhile
        row = await tx.fetchone(find, (sender_id, key))
        if row is None:
            raise RuntimeError("the send's debit vanished in its own transaction")
        packet_id = PacketId(int(row[0]))
        if not posted:
            return packet_id
        await set_packet(tx, sender_id, packet_id, packet_id)
        data = event(packet_id)
        await events.record(tx, "packet.sent", key, sender_id, -total, data, now_ms())
        return packet_id

    return await db.run(work, idempotent=True)


async def create_packet(
    db: Database,
    packet_id: PacketId,
    made_by: tuple[int, str, str],
    insert: Callable[[Tx], Awaitable[None]],
) -> bool:
    """Step 2 of a send, on the packet's shard: ``insert`` (the packet's row with id ``packet_id`` and its
    shares), unless the row is there. Returns whether this call made it: ``made_by`` (sender, request id,
    seed) is the row this call writes — its seed drawn for this call alone —, so a run again after a lost
    COMMIT answer knows its own row.
    A row of another call of the same request is a replay; a ``void`` one (``void_unsent`` refunded the
    debit) refuses the send, as does a row of another send (ids that met: never paid into)."""

    async def work(tx: Tx) -> str:
        look = "SELECT status, sender_id, request_id, seed FROM red_packets WHERE id = %s"
        row = await tx.fetchone(look, (packet_id,))
        if row is None:
            try:
                await insert(tx)
                return "made"
            except PacketKeyTaken:  # made meanwhile: by a retry of this send, or voided
                row = await tx.fetchone(look, (packet_id,))
        if row is None:
            raise RuntimeError(f"packet {packet_id}'s key refused it and its row is not there")
        if row[0] == VOID:
            return VOID
        sender, request, seed = made_by
        if (int(row[1]), as_text(row[2])) != (sender, request):
            raise RuntimeError(f"packet {packet_id} is another send's: two debits were given one id")
        return "made" if tx.resumed and row[3] is not None and as_text(row[3]) == seed else "there"

    found = await db.run(work, idempotent=True)
    if found == VOID:
        raise Conflict(
            errors.IDEMPOTENCY_KEY_REUSED,
            "this request_id's send never completed and was refunded: send again with a new request_id",
        )
    return found == "made"


# The status of a packet row that only says its send was abandoned: its debit is refunded, and it is never
# made, loaded or grabbed. How long after its debit a send with no packet is taken for abandoned:
VOID = PacketStatus.VOID
UNSENT_MS = 10 * 60 * 1000


async def void_unsent(db: Database, older_than_ms: int, since_ms: int, limit: int = 500) -> int:
    """Refund every send debited before ``older_than_ms`` (and since ``since_ms``) whose packet was never
    made: first a ``void`` packet row with the debit's id on the packet's shard (its key decides between
    this and a late creation, ``create_packet``), then the refund on the sender's. Also pays the refund
    of a void row a run stopped before paying. Returns how many refunds this call posted."""
    refund_of = db.dialect.concat(f"'{REFUND_PREFIX}'", "j.packet_id")
    unsent = await db.fetchall(
        "SELECT j.account_id, j.packet_id, j.amount FROM journal j"
        " WHERE j.kind = 'send' AND j.created_ms < %s AND j.created_ms >= %s"
        " AND NOT EXISTS (SELECT 1 FROM red_packets p WHERE p.id = j.packet_id) LIMIT %s",
        (older_than_ms, since_ms, limit),
    )
    unpaid = await db.fetchall(
        f"SELECT p.sender_id, p.id, -p.total FROM red_packets p WHERE p.status = '{PacketStatus.VOID}' AND"
        " NOT EXISTS"
        f" (SELECT 1 FROM journal j WHERE j.account_id = p.sender_id AND j.packet_id = p.id"
        f" AND j.idem_key = {refund_of}) LIMIT %s",
        (limit,),
    )
    voided = 0
    for account, pid, amount in [*unsent, *unpaid]:
        sender, packet_id, total = int(account), PacketId(int(pid)), -int(amount)

        async def void(
            tx: Tx, sender: int = sender, packet_id: PacketId = packet_id, total: int = total
        ) -> bool:
            await tx.execute(
                f"{tx.dialect.insert_ignore} INTO red_packets (id, sender_id, group_id, kind, total,"
                " share_count, greeting, status, created_ms, expires_ms, finished_ms, credited_count)"
                f" VALUES (%s, %s, 0, '{PacketStatus.VOID}', %s, 1, '', %s, %s, 0, %s, 0)",
                (packet_id, sender, total, VOID, now_ms(), now_ms()),
            )
            row = await tx.fetchone("SELECT status FROM red_packets WHERE id = %s", (packet_id,))
            return row is not None and row[0] == VOID

        if not await db.run(void, idempotent=True):
            continue  # made after all: a send, not abandoned

        async def pay(
            tx: Tx, sender: int = sender, packet_id: PacketId = packet_id, total: int = total
        ) -> bool:
            # (group 0: the group is the packet's, never made)
            return await post_refund(tx, packet_id=packet_id, group_id=0, sender_id=sender, amount=total)

        voided += await db.run(pay, idempotent=True)
    return voided
