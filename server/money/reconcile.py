"""Reconciliation: every cent accounted for, per packet and across the whole ledger.

The arithmetic is pure (``check``); ``gather`` reads the numbers from the database. Zero tolerance: any
difference is reported.

    per packet:  debited = total;  credited + refunded + outstanding = total, outstanding ≥ 0,
                 outstanding = 0 once the packet is finished or refunded;
                 credited in the journal = credited in grab_records
    per account: balance = sum of its journal
    global:      money in (top-ups) = money in balances + money held in packets (outstanding)
"""

from __future__ import annotations

from dataclasses import dataclass

from server.store.db import Database


@dataclass(frozen=True)
class PacketBooks:
    packet_id: int
    status: str
    total: int
    debited: int
    credited: int
    refunded: int
    credited_records: int

    @property
    def outstanding(self) -> int:
        return self.total - self.credited - self.refunded


@dataclass(frozen=True)
class Difference:
    check: str
    subject: str
    expected: int
    actual: int

    def __str__(self) -> str:
        return f"{self.check} {self.subject}: expected {self.expected}, found {self.actual}"


@dataclass(frozen=True)
class Books:
    packets: list[PacketBooks]
    accounts: list[tuple[int, int, int]]  # (user, balance, journal sum)
    topups: int


@dataclass(frozen=True)
class Report:
    differences: list[Difference]
    packets: int
    accounts: int
    money_in: int
    in_balances: int
    held_in_packets: int

    @property
    def ok(self) -> bool:
        return not self.differences


def check(books: Books) -> Report:
    """Every difference in ``books``. Pure."""
    diffs: list[Difference] = []
    for p in books.packets:
        name = f"packet {p.packet_id}"
        if p.debited != p.total:
            diffs.append(Difference("packet_debit", name, p.total, p.debited))
        if p.outstanding < 0:
            diffs.append(Difference("packet_overpaid", name, p.total, p.credited + p.refunded))
        elif p.status in ("finished", "refunded") and p.outstanding != 0:
            diffs.append(Difference("packet_unsettled", name, 0, p.outstanding))
        if p.credited != p.credited_records:
            diffs.append(Difference("packet_credit_records", name, p.credited, p.credited_records))
    for user, balance, journal in books.accounts:
        if balance != journal:
            diffs.append(Difference("account_journal", f"account {user}", journal, balance))
    in_balances = sum(balance for _, balance, _ in books.accounts)
    held = sum(max(p.outstanding, 0) for p in books.packets)
    if books.topups != in_balances + held:
        diffs.append(Difference("global", "money in = balances + held", books.topups, in_balances + held))
    return Report(diffs, len(books.packets), len(books.accounts), books.topups, in_balances, held)


async def gather(db: Database) -> Books:
    """Every figure, read in one snapshot: credits and top-ups committed meanwhile are all in or all out
    (read apart, they made a reconciliation under load report differences that were not there)."""
    async with db.snapshot() as tx:
        packets = await tx.fetchall("SELECT id, status, total FROM red_packets")
        sums = await tx.fetchall(
            "SELECT packet_id, kind, SUM(amount) FROM journal"
            " WHERE packet_id IS NOT NULL GROUP BY packet_id, kind"
        )
        records = await tx.fetchall(
            "SELECT packet_id, SUM(amount) FROM grab_records WHERE status = 'credited' GROUP BY packet_id"
        )
        accounts = await tx.fetchall(
            "SELECT a.user_id, a.balance, COALESCE(SUM(j.amount), 0) FROM accounts a"
            " LEFT JOIN journal j ON j.account_id = a.user_id GROUP BY a.user_id, a.balance"
        )
        topups = await tx.fetchone("SELECT COALESCE(SUM(amount), 0) FROM journal WHERE kind = 'topup'")
    by_kind: dict[tuple[int, str], int] = {(int(r[0]), str(r[1])): int(r[2]) for r in sums}
    credited_records = {int(r[0]): int(r[1]) for r in records}
    books = [
        PacketBooks(
            packet_id=int(pid),
            status=str(status),
            total=int(total),
            debited=-by_kind.get((int(pid), "send"), 0),
            credited=by_kind.get((int(pid), "grab"), 0),
            refunded=by_kind.get((int(pid), "refund"), 0),
            credited_records=credited_records.get(int(pid), 0),
        )
        for pid, status, total in packets
    ]
    return Books(
        books,
        [(int(u), int(b), int(j)) for u, b, j in accounts],
        int(topups[0]) if topups else 0,
    )


async def reconcile(db: Database) -> Report:
    return check(await gather(db))


def render(report: Report) -> str:
    held, balances = report.held_in_packets, report.in_balances
    verdict = "ok" if report.money_in == balances + held else "MISMATCH"
    lines = [
        f"packets {report.packets}, accounts {report.accounts}",
        f"money in {report.money_in} = in balances {balances} + held in packets {held} ({verdict})",
    ]
    lines += [f"DIFFERENCE {d}" for d in report.differences]
    lines.append("reconciled: no difference" if report.ok else f"{len(report.differences)} difference(s)")
    return "\n".join(lines)
