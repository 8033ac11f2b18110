"""Reconciliation of what leaves the ledger (withdrawals, holds) and of the event outbox, beside
``server.money.reconcile``'s packets and accounts.

    money out:   withdrawn + on hold = -(journal withdraw + hold + release rows): the global check's
                 third term (money in = balances + held in packets + money out)
    per hold:    its hold row debited its amount from its user; released or expired ⇔ a release row
                 paid it back, to that user; a journal hold or release row has its hold; a hold held
                 past LATE_MS after its expiry is stuck (the expiry job is not running)
    events:      every journal row (since events were written) has its event, with the same key, user and
                 amount (a grab's: its transaction's row of credits, which holds as many events and cents
                 as the transaction's grab rows); every money event has its journal row; every finished
                 packet sent since has its ``packet.finished``, every confirmed hold its
                 ``hold.confirmed``; and no event says what the ledger does not (a confirmation of a hold
                 not confirmed, the end of a packet not finished, a money event of another kind than its
                 journal row, a row of credits of another type)

The arithmetic is pure (``differences``); the reads are ``queries``, run in reconcile's snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from server.money.statuses import PacketStatus
from server.store.db import Row, as_text
from server.store.dialect import Dialect

LATE_MS = 15 * 60 * 1000
# The events a journal row of each kind may have (its key is theirs).
EVENT_OF_KIND: dict[str, tuple[str, ...]] = {
    "topup": ("account.topup",),
    "send": ("packet.sent",),
    "grab": ("share.credited",),
    "refund": ("packet.refunded",),
    "withdraw": ("account.withdrawn",),
    "hold": ("hold.created",),
    "release": ("hold.released", "hold.expired"),
}
_SINCE = "(SELECT journal_from FROM event_counter WHERE name = 'events')"


def queries(d: Dialect) -> dict[str, tuple[str, tuple[object, ...]]]:
    """Every read, by name (keys built in SQL as ``server.money.payouts`` and ``ledger`` build them)."""
    hold_key, release_key = d.concat("'hold:'", "h.request_id"), d.concat("'release:'", "h.request_id")
    finished_key = d.concat("'finished:'", "p.id")
    credits_key = d.concat("'credits:'", "j.tx")
    confirm_key = d.concat("'confirm:'", "h.request_id")
    fitting = " OR ".join(
        f"(j.kind = '{kind}' AND e.type IN ({', '.join(repr(t) for t in types)}))"
        for kind, types in EVENT_OF_KIND.items()
    )
    return {
        "out": (
            "SELECT kind, COALESCE(SUM(amount), 0) FROM journal"
            " WHERE kind IN ('withdraw', 'hold', 'release') GROUP BY kind",
            (),
        ),
        "holds": (
            "SELECT h.request_id, h.user_id, h.amount, h.state, h.expires_ms,"
            f" (SELECT COUNT(*) FROM journal j WHERE j.idem_key = {hold_key}"
            "  AND j.account_id = h.user_id AND j.amount = -h.amount),"
            f" (SELECT COUNT(*) FROM journal j WHERE j.idem_key = {release_key}"
            "  AND j.account_id = h.user_id AND j.amount = h.amount)"
            " FROM holds h",
            (),
        ),
        "hold_orphans": (
            "SELECT j.idem_key, j.account_id, j.amount FROM journal j"
            " LEFT JOIN holds h ON h.request_id = SUBSTR(j.idem_key, INSTR(j.idem_key, ':') + 1)"
            " WHERE j.kind IN ('hold', 'release') AND h.request_id IS NULL",
            (),
        ),
        # A grab journal row's event may be its transaction's row of credits (server.money.events).
        "event_missing": (
            "SELECT j.idem_key, j.account_id, j.amount FROM journal j LEFT JOIN events e"
            " ON e.idem_key = j.idem_key AND e.user_id = j.account_id AND e.amount = j.amount"
            f" LEFT JOIN events c ON j.kind = 'grab' AND c.idem_key = {credits_key}"
            " AND c.created_ms = j.created_ms AND c.type = 'share.credited'"
            f" WHERE j.id > {_SINCE} AND e.id IS NULL AND c.id IS NULL",
            (),
        ),
        "event_unbacked": (
            "SELECT e.idem_key, e.user_id, e.amount FROM events e LEFT JOIN journal j"
            " ON j.idem_key = e.idem_key AND j.account_id = e.user_id AND j.amount = e.amount"
            " WHERE e.amount IS NOT NULL AND e.tx IS NULL AND j.id IS NULL",
            (),
        ),
        # A row of credits holds as many events, of as many cents, as its transaction's grab journal rows
        # (those with its token, written at its time: server.money.events.record_credits).
        "event_credits": (
            "SELECT c.idem_key, c.n, c.amount, COUNT(j.id), COALESCE(SUM(j.amount), 0) FROM events c"
            " LEFT JOIN journal j ON j.tx = c.tx AND j.created_ms = c.created_ms AND j.kind = 'grab'"
            " WHERE c.tx IS NOT NULL"
            " GROUP BY c.id, c.idem_key, c.n, c.amount"
            " HAVING COUNT(j.id) <> c.n OR COALESCE(SUM(j.amount), 0) <> c.amount",
            (),
        ),
        # Events that move no money say something of a hold or a packet: it must be so. A money event
        # without an amount, or of a type its journal row's kind is not, is no event of that row.
        "event_untrue": (
            "SELECT e.idem_key, e.user_id, e.type FROM events e"
            f" LEFT JOIN holds h ON e.idem_key = {confirm_key} AND h.state = 'confirmed'"
            " WHERE e.type = 'hold.confirmed' AND h.request_id IS NULL"
            " UNION ALL SELECT e.idem_key, e.user_id, e.type FROM events e"
            f" LEFT JOIN red_packets p ON e.idem_key = {finished_key} AND p.status ="
            f" '{PacketStatus.FINISHED}'"
            " WHERE e.type = 'packet.finished' AND p.id IS NULL"
            " UNION ALL SELECT e.idem_key, e.user_id, e.type FROM events e"
            " WHERE e.amount IS NULL AND e.type NOT IN ('hold.confirmed', 'packet.finished')"
            " UNION ALL SELECT e.idem_key, e.user_id, e.type FROM events e"
            " WHERE e.tx IS NOT NULL AND e.type <> 'share.credited'"
            " UNION ALL SELECT e.idem_key, e.user_id, e.type FROM events e"
            f" JOIN journal j ON j.idem_key = e.idem_key WHERE NOT ({fitting})",
            (),
        ),
        "finish_unannounced": (
            "SELECT p.id, p.sender_id FROM red_packets p"
            # (By the debit's packet, not its key: a sharded send's key is send:<sender>:<request>.)
            " JOIN journal s ON s.packet_id = p.id AND s.kind = 'send'"
            f" LEFT JOIN events e ON e.idem_key = {finished_key}"
            f" WHERE p.status = '{PacketStatus.FINISHED}' AND s.id > {_SINCE} AND e.id IS NULL",
            (),
        ),
        "confirm_unannounced": (
            "SELECT h.request_id, h.user_id, h.amount FROM holds h"
            f" LEFT JOIN events e ON e.idem_key = {confirm_key}"
            " WHERE h.state = 'confirmed' AND e.id IS NULL",
            (),
        ),
    }


@dataclass(frozen=True)
class HoldBooks:
    request_id: str
    user_id: int
    amount: int
    state: str
    expires_ms: int
    debits: int  # journal hold rows matching it (1)
    pay_backs: int  # journal release rows matching it (1 once released or expired, else 0)


@dataclass(frozen=True)
class OutBooks:
    withdrawn: int = 0  # cents, positive
    held_net: int = 0  # -(hold rows + release rows): on hold now, plus confirmed
    holds: list[HoldBooks] = field(default_factory=list)
    orphans: list[tuple[str, int, int]] = field(default_factory=list)  # (key, account, amount)
    event_missing: list[tuple[str, int, int]] = field(default_factory=list)
    event_unbacked: list[tuple[str, int, int]] = field(default_factory=list)
    # (key, events it says, cents it says, grab journal rows of its transaction, their cents)
    event_credits: list[tuple[str, int, int, int, int]] = field(default_factory=list)
    unannounced: list[str] = field(default_factory=list)
    untrue: list[tuple[str, int, str]] = field(default_factory=list)  # (key, user, type)

    @property
    def paid_out(self) -> int:
        """What left the ledger, or is held to leave it: withdrawn, confirmed and on hold."""
        return self.withdrawn + self.held_net


def books(rows: dict[str, list[Row]]) -> OutBooks:
    """The figures read, put together. Pure."""
    out = {str(k): int(v) for k, v in rows["out"]}
    return OutBooks(
        withdrawn=-out.get("withdraw", 0),
        held_net=-(out.get("hold", 0) + out.get("release", 0)),
        holds=[
            HoldBooks(as_text(r), int(u), int(a), str(s), int(e), int(d), int(b))
            for r, u, a, s, e, d, b in rows["holds"]
        ],
        orphans=[(as_text(k), int(a), int(m)) for k, a, m in rows["hold_orphans"]],
        event_missing=[(as_text(k), int(a), int(m)) for k, a, m in rows["event_missing"]],
        event_unbacked=[(as_text(k), int(a), int(m)) for k, a, m in rows["event_unbacked"]],
        event_credits=[
            (as_text(k), int(n), int(a), int(c), int(s)) for k, n, a, c, s in rows["event_credits"]
        ],
        untrue=[(as_text(k), int(u), str(t)) for k, u, t in rows["event_untrue"]],
        unannounced=[f"packet {int(p)} finished" for p, _ in rows["finish_unannounced"]]
        + [f"hold {as_text(r)} confirmed" for r, _, _ in rows["confirm_unannounced"]],
    )


def differences(b: OutBooks, now_ms: int) -> list[tuple[str, str, int, int]]:
    """(check, subject, expected, actual) for every difference in ``b``. Pure."""
    diffs: list[tuple[str, str, int, int]] = []
    for h in b.holds:
        name = f"hold {h.request_id} of user {h.user_id}"
        if h.debits != 1:
            diffs.append(("hold_debit", name, 1, h.debits))
        paid_back = 1 if h.state in ("released", "expired") else 0
        if h.pay_backs != paid_back:
            diffs.append(("hold_release", f"{name} {h.state}", paid_back, h.pay_backs))
        if h.state == "held" and h.expires_ms < now_ms - LATE_MS:
            diffs.append(
                ("hold_stuck", f"{name}, expired {(now_ms - h.expires_ms) // 1000} s ago", 0, h.amount)
            )
    for key, account, amount in b.orphans:
        diffs.append(("hold_posting", f"{key} to account {account} has no hold", 0, amount))
    for key, account, amount in b.event_missing:
        diffs.append(("event_missing", f"{key} to account {account} has no event", amount, 0))
    for key, account, amount in b.event_unbacked:
        diffs.append(("event_unbacked", f"event {key} for user {account} has no journal row", 0, amount))
    for key, n, amount, rows_, cents in b.event_credits:
        if rows_ != n:
            diffs.append(
                ("event_credits", f"event {key} holds {n} credits; its transaction posted {rows_}", n, rows_)
            )
        if cents != amount:
            diffs.append(
                (
                    "event_credits",
                    f"event {key} says {amount} cents; its transaction posted {cents}",
                    amount,
                    cents,
                )
            )
    for key, user, type_ in b.untrue:
        diffs.append(
            ("event_untrue", f"event {key} ({type_}) for user {user} says what the ledger does not", 0, 1)
        )
    for what in b.unannounced:
        diffs.append(("event_missing", f"{what} with no event", 1, 0))
    return diffs
