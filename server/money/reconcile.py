"""Reconciliation: every cent accounted for, per packet, per posting, per grab Redis answered, and across
the whole ledger.

The arithmetic is pure (``check``); ``gather`` reads the figures, from the database in one snapshot and
from Redis (what it told grabbers). Zero tolerance: any difference is reported.

    per packet:   debited = total = the sum of its shares, count = its shares;
                  credited + refunded + outstanding = total, outstanding ≥ 0,
                  outstanding = 0 once the packet is finished or refunded;
                  credited in the journal = credited in grab_records;
                  its row's count of shares paid = its grab records credited;
                  expired longer than LATE_MS ago and still not settled: a difference
    per posting:  a send or refund goes to the packet's sender, a grab credit to the grab record's user,
                  of that share, for that amount (and every credited grab record has its posting);
                  a grab record's amount is its share's;
                  one ``Database.run`` call posts one send, top-up, refund, withdrawal, hold or release
                  (never two: a second one is a transaction run again without its key)
    per grab:     every grab the ledger refused (``credit_refusals``) and has not paid since;
                  every grab Redis holds matches the database's record of it, if any, and one older
                  than LATE_MS has one
    per account:  balance = sum of its journal
    global:       money in (top-ups) = money in balances + money held in packets (outstanding) + money
                  paid out (withdrawn, and held for a payout): ``server.money.outflows``, which also
                  checks holds and the event outbox against the journal
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from redis.exceptions import RedisError

from server.core import Core
from server.ids import GroupId, PacketId
from server.money import outflows, reconcilesql
from server.money.ledger import now_ms
from server.money.outflows import OutBooks
from server.money.reconcilereport import Difference, Report, confirmed, per_shard
from server.money.reconcilesql import RECENT_MS
from server.money.statuses import OPEN, SETTLED, PacketStatus
from server.store import keys
from server.store.db import Database, Row
from server.store.records import GrabRecord

# A grab not paid, or an expired packet not settled, this long after is a difference: credits land in
# seconds and the refund job runs every minute (a worker that stays away longer is worth an alert).
LATE_MS = 15 * 60 * 1000
PACKETS_A_READ = 20  # packets whose grabs Redis is asked for in one pipeline


@dataclass(frozen=True)
class PacketBooks:
    packet_id: int
    status: str
    total: int
    debited: int
    credited: int
    refunded: int
    credited_records: int
    count: int = 0
    shares_total: int = 0
    shares_count: int = 0
    expires_ms: int = 0
    records_paid: int = 0  # its grab records credited
    credited_count: int | None = None  # its row's count of them (None: sent before it was kept)

    @property
    def outstanding(self) -> int:
        return self.total - self.credited - self.refunded


@dataclass(frozen=True)
class Posting:
    """A journal row that went wrong: which packet, what kind, to which account, how much."""

    packet_id: int
    kind: str
    account_id: int
    amount: int
    expected_account: int


@dataclass(frozen=True)
class GrabRow:
    """A grab as one side has it: packet, user, share, amount (and, from Redis, when it was made)."""

    packet_id: int
    user_id: int
    seq: int
    amount: int
    grabbed_ms: int = 0
    note: str = ""  # a refusal's code and who refused it


@dataclass(frozen=True)
class Books:
    packets: list[PacketBooks]
    accounts: list[tuple[int, int, int]]  # (user, balance, journal sum)
    topups: int
    wrong_account: list[Posting] = field(default_factory=list)
    grab_postings_unmatched: list[GrabRow] = field(default_factory=list)  # journal rows with no record
    records_unposted: list[GrabRow] = field(default_factory=list)  # credited records with no journal row
    records_off_share: list[GrabRow] = field(default_factory=list)  # amount is not the share's
    refused: list[GrabRow] = field(default_factory=list)  # refused and not paid since
    repeated: list[tuple[int, int]] = field(default_factory=list)  # (call token, postings)
    # A sharded ledger's money between steps: credits decided and not yet marked paid (their posting
    # counted with the records once made), and sends debited whose packet is not made (nor refunded).
    crediting: list[GrabRow] = field(default_factory=list)
    unsent: list[tuple[int, int, int]] = field(default_factory=list)  # (packet id, debited, when)
    # Redis: packet → its grabs there; the database's records of those packets (credited or not).
    redis_grabs: dict[int, list[GrabRow]] = field(default_factory=dict)
    db_grabs: dict[int, list[GrabRow]] = field(default_factory=dict)
    redis_error: str = ""
    now_ms: int = 0
    outflows: OutBooks = field(default_factory=OutBooks)


def _grab_name(g: GrabRow) -> str:
    return f"packet {g.packet_id} user {g.user_id} share {g.seq}"


KNOWN_STATUSES = frozenset(s.value for s in PacketStatus)


def check(books: Books) -> Report:
    """Every difference in ``books``. Pure."""
    diffs: list[Difference] = []
    for p in books.packets:
        name = f"packet {p.packet_id}"
        if p.debited != p.total:
            diffs.append(Difference("packet_debit", name, p.total, p.debited))
        if p.status not in KNOWN_STATUSES:  # written by no code of ours: nothing below can judge it
            diffs.append(Difference("packet_status", f"{name} status {p.status!r}", 0, p.outstanding))
        if p.status != PacketStatus.VOID and (p.shares_total, p.shares_count) != (p.total, p.count):
            diffs.append(Difference("packet_shares", name + " shares sum", p.total, p.shares_total))
        if p.outstanding < 0:
            diffs.append(Difference("packet_overpaid", name, p.total, p.credited + p.refunded))
        elif p.status in SETTLED and p.outstanding != 0:
            diffs.append(Difference("packet_unsettled", name, 0, p.outstanding))
        if p.credited != p.credited_records:
            diffs.append(Difference("packet_credit_records", name, p.credited, p.credited_records))
        if p.credited_count is not None and p.credited_count != p.records_paid:
            diffs.append(
                Difference("packet_paid_count", name + " shares paid", p.records_paid, p.credited_count)
            )
        if p.status in OPEN and p.expires_ms and p.expires_ms < books.now_ms - LATE_MS:
            late_s = (books.now_ms - p.expires_ms) // 1000
            diffs.append(
                Difference("packet_stuck", f"{name} {p.status}, expired {late_s} s ago", 0, p.outstanding)
            )
    for w in books.wrong_account:
        diffs.append(
            Difference(
                "posting_account",
                f"packet {w.packet_id} {w.kind} of {w.amount}",
                w.expected_account,
                w.account_id,
            )
        )
    for g in books.grab_postings_unmatched:
        diffs.append(Difference("grab_posting", f"{_grab_name(g)} posted with no grab record", 0, g.amount))
    for g in books.records_unposted:
        diffs.append(Difference("grab_posting", f"{_grab_name(g)} credited with no posting", g.amount, 0))
    for g in books.records_off_share:
        diffs.append(Difference("grab_share", _grab_name(g), int(g.note or 0), g.amount))
    for g in books.refused:
        diffs.append(Difference("credit_refused", f"{_grab_name(g)} ({g.note})", g.amount, 0))
    for token, n in books.repeated:
        diffs.append(Difference("repeated_posting", f"transaction {token}", 1, n))
    for g in books.crediting:
        if g.grabbed_ms < books.now_ms - LATE_MS:
            diffs.append(Difference("credit_unfinished", f"{_grab_name(g)} ({g.note})", g.amount, 0))
    for pid, debited, at in books.unsent:
        if at < books.now_ms - LATE_MS:  # (younger: between its steps, or the sweeper's to refund)
            diffs.append(Difference("send_unfinished", f"packet {pid} debited and not made", 0, debited))
    diffs += _redis_differences(books)
    diffs += [Difference(*d) for d in outflows.differences(books.outflows, books.now_ms)]
    for user, balance, journal in books.accounts:
        if balance != journal:
            diffs.append(Difference("account_journal", f"account {user}", journal, balance))
    in_balances = sum(balance for _, balance, _ in books.accounts)
    held = sum(max(p.outstanding, 0) for p in books.packets) + sum(d for _, d, _ in books.unsent)
    out = books.outflows.paid_out
    if books.topups != in_balances + held + out:
        diffs.append(
            Difference(
                "global", "money in = balances + held + paid out", books.topups, in_balances + held + out
            )
        )
    return Report(diffs, len(books.packets), len(books.accounts), books.topups, in_balances, held, out)


def _redis_differences(books: Books) -> list[Difference]:
    """Each grab Redis holds (what its grabber was told, and sees on opening the packet) against the
    database: the same share for the same amount, and paid once it is older than ``LATE_MS``."""
    if books.redis_error:
        return [Difference("redis_unreadable", books.redis_error, 0, 0)]
    diffs = []
    for pid, grabs in books.redis_grabs.items():
        db = books.db_grabs.get(pid, [])
        by_user = {g.user_id: g for g in db}
        by_seq = {g.seq: g for g in db}
        for g in grabs:
            mine, holder = by_user.get(g.user_id), by_seq.get(g.seq)
            if mine is not None and (mine.seq, mine.amount) != (g.seq, g.amount):
                diffs.append(
                    Difference(
                        "redis_grab",
                        f"{_grab_name(g)}: the ledger has share {mine.seq}",
                        g.amount,
                        mine.amount,
                    )
                )
            elif mine is None and holder is not None:
                diffs.append(
                    Difference(
                        "redis_grab",
                        f"{_grab_name(g)}: the ledger gave it to user {holder.user_id}",
                        g.amount,
                        0,
                    )
                )
            elif mine is None and g.grabbed_ms < books.now_ms - LATE_MS:
                diffs.append(Difference("redis_grab_unpaid", _grab_name(g), g.amount, 0))
    return diffs


# Told what a reconciliation is doing, as it goes (the command says it on stderr: a big ledger takes minutes).
Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


async def gather(core: Core, now: int | None = None, progress: Progress = _quiet) -> Books:
    """Every figure: the database's read in one snapshot (credits and top-ups committed meanwhile are all
    in or all out — read apart, they made a reconciliation under load report differences that were not
    there), then the grabs Redis holds for the packets not settled long ago. (A worker runs all of it in a
    child process: ``worker.settle.reconcile_in_child``.)"""
    now = now_ms() if now is None else now
    progress("reading the ledger (one snapshot)")
    books, live = await _gather_db(core.db, now)
    progress(f"read {len(books.accounts):,} accounts and {len(books.packets):,} packets")
    try:
        redis_grabs = await _redis_grabs(core, live, progress)
    except RedisError as e:
        return replace(books, redis_error=f"cannot read Redis: {e}")
    return replace(books, redis_grabs=redis_grabs)


async def _redis_grabs(
    core: Core, packets: dict[int, int], progress: Progress = _quiet
) -> dict[int, list[GrabRow]]:
    """packet → the grabs its Redis hash holds, read ``PACKETS_A_READ`` packets a pipeline (its answers are
    parsed on the caller's loop in one go: the fewer packets, the shorter it holds that loop)."""
    out: dict[int, list[GrabRow]] = {}
    items = sorted(packets.items())
    for i in range(0, len(items), PACKETS_A_READ):
        if i % 50_000 == 0:
            progress(f"reading what Redis holds of {len(items):,} packets: {i:,} so far")
        chunk = items[i : i + PACKETS_A_READ]
        async with core.redis.pipeline(transaction=False) as pipe:
            for pid, gid in chunk:
                pipe.hgetall(keys.packet_grabs(group_id=GroupId(gid), packet_id=PacketId(pid)))
            answers = await pipe.execute()
        for (pid, _), held in zip(chunk, answers, strict=True):
            rows = []
            for user, record in held.items():
                r = GrabRecord.parse(record)
                rows.append(GrabRow(pid, int(user), r.seq, r.amount, r.grabbed_ms))
            if rows:
                out[pid] = rows
    return out


async def _gather_db(db: Database, now: int) -> tuple[Books, dict[int, int]]:
    """The database's figures, and the packets (id → group) whose grabs are compared with Redis's."""
    reads = {**reconcilesql.queries(db.dialect, now), **outflows.queries(db.dialect)}
    async with db.snapshot() as tx:
        rows = {name: await tx.fetchall(sql, args) for name, (sql, args) in reads.items()}
    return _books(rows, now)


def _books(rows: dict[str, list[Row]], now: int) -> tuple[Books, dict[int, int]]:
    """The figures read (``reconcilesql.queries``) put together. Pure."""
    packets, sums, records, shares = rows["packets"], rows["sums"], rows["records"], rows["shares"]
    accounts, topups, wrong, unmatched = rows["accounts"], rows["topups"], rows["wrong"], rows["unmatched"]
    unposted, off_share, refused = rows["unposted"], rows["off_share"], rows["refused"]
    repeated, compared = rows["repeated"], rows["compared"]
    by_kind: dict[tuple[int, str], int] = {(int(r[0]), str(r[1])): int(r[2]) for r in sums}
    credited_records = defaultdict(int, {int(r[0]): int(r[1]) for r in records})
    records_paid = {int(r[0]): int(r[2]) for r in records}
    crediting = []
    for pid, uid, seq, amount, grabbed, posted in rows["crediting"]:
        note = "posted, not marked paid" if int(posted) else "decided, not posted"
        crediting.append(GrabRow(int(pid), int(uid), int(seq), int(amount), int(grabbed), note))
        credited_records[int(pid)] += int(amount) if int(posted) else 0
    made = {int(r[0]) for r in packets}
    debited_at = {int(r[0]): int(r[3]) for r in sums if str(r[1]) == "send"}
    unsent = sorted(
        (pid, -(by_kind.get((pid, "send"), 0) + by_kind.get((pid, "refund"), 0)), debited_at.get(pid, 0))
        for pid in {pid for pid, _ in by_kind} - made
    )
    share_sums = {int(r[0]): (int(r[1]), int(r[2])) for r in shares}
    books = [
        PacketBooks(
            packet_id=int(pid),
            status=str(status),
            total=int(total),
            debited=-by_kind.get((int(pid), "send"), 0),
            credited=by_kind.get((int(pid), "grab"), 0),
            refunded=by_kind.get((int(pid), "refund"), 0),
            credited_records=credited_records.get(int(pid), 0),
            count=int(count),
            shares_total=share_sums.get(int(pid), (0, 0))[0],
            shares_count=share_sums.get(int(pid), (0, 0))[1],
            expires_ms=int(expires),
            records_paid=records_paid.get(int(pid), 0),
            credited_count=None if paid is None else int(paid),
        )
        for pid, status, total, count, expires, group, _, paid in packets
    ]
    db_grabs: dict[int, list[GrabRow]] = defaultdict(list)
    for pid, uid, seq, amount in compared:
        db_grabs[int(pid)].append(GrabRow(int(pid), int(uid), int(seq), int(amount)))
    live = {
        int(pid): int(group)
        for pid, status, _, _, _, group, finished, _ in packets
        if status in OPEN
        or (status == PacketStatus.FINISHED and finished is not None and int(finished) >= now - RECENT_MS)
    }
    result = Books(
        books,
        [(int(u), int(b), int(j)) for u, b, j in accounts],
        int(topups[0][0]) if topups else 0,
        wrong_account=[Posting(int(p), str(k), int(a), int(m), int(s)) for p, k, a, m, s in wrong],
        grab_postings_unmatched=[GrabRow(int(p), int(a), 0, int(m)) for p, a, m in unmatched],
        records_unposted=[GrabRow(int(p), int(u), int(s), int(m)) for p, u, s, m in unposted],
        records_off_share=[
            GrabRow(int(p), int(u), int(s), int(m), note=str(e)) for p, u, s, m, e in off_share
        ],
        refused=[
            GrabRow(int(p), int(u), int(s), int(m), note=f"{c}, by {b}") for p, u, s, m, c, b in refused
        ],
        repeated=[(int(t), int(n)) for t, n in repeated],
        crediting=crediting,
        unsent=[u for u in unsent if u[1]],
        db_grabs=dict(db_grabs),
        now_ms=now,
        outflows=outflows.books(rows),
    )
    return result, live


async def reconcile(core: Core, now: int | None = None, progress: Progress = _quiet) -> Report:
    """``check`` of ``gather``. On a sharded ledger the shards are read one after another, not in one
    snapshot: a money move between its steps can show as a difference once, so a report with differences
    is read again and keeps those found both times (``reconcilereport.confirmed``); the per-shard figures
    are added."""
    now = now_ms() if now is None else now  # (one time for both reads: "expired N s ago" stays the same)
    books = await gather(core, now, progress)
    progress("comparing")
    report = check(books)
    if core.db.shards and not report.ok:
        progress("differences on a sharded ledger: reading it again, to keep those found both times")
        report = confirmed(report, check(await gather(core, now, progress)))
    held = [(p.packet_id, max(p.outstanding, 0)) for p in books.packets]
    shards = per_shard(held, [(u, b) for u, b, _ in books.accounts], report, core.db.shards)
    return replace(report, shards=shards)
