"""The database's side of a reconciliation (``server.money.reconcile``): every read, by name, run in one
snapshot."""

from __future__ import annotations

from server.money.statuses import PacketStatus, RecordStatus
from server.store.dialect import Dialect

# Packets finished this recently are compared with Redis too (older ones are settled for good).
RECENT_MS = 60 * 60 * 1000


def queries(dialect: Dialect, now: int) -> dict[str, tuple[str, tuple[object, ...]]]:
    """Every read of the database's side, by name: run in one snapshot."""
    grab_key = dialect.concat("'grab:'", "g.packet_id", "':'", "g.seq")  # ledger.grab_key, in SQL
    return {
        "packets": (
            "SELECT id, status, total, share_count, expires_ms, group_id, finished_ms, credited_count"
            " FROM red_packets",
            (),
        ),
        "sums": (
            "SELECT packet_id, kind, SUM(amount), MIN(created_ms) FROM journal"
            " WHERE packet_id IS NOT NULL GROUP BY packet_id, kind",
            (),
        ),
        "records": (
            "SELECT packet_id, SUM(amount), COUNT(*) FROM grab_records"
            f" WHERE status = '{RecordStatus.CREDITED}' GROUP BY packet_id",
            (),
        ),
        "shares": (
            "SELECT packet_id, SUM(amount), COUNT(*) FROM red_packet_shares GROUP BY packet_id",
            (),
        ),
        "accounts": (
            "SELECT a.user_id, a.balance, COALESCE(SUM(j.amount), 0) FROM accounts a"
            " LEFT JOIN journal j ON j.account_id = a.user_id GROUP BY a.user_id, a.balance",
            (),
        ),
        "topups": (
            "SELECT COALESCE(SUM(amount), 0) FROM journal WHERE kind = 'topup'",
            (),
        ),
        "wrong": (
            "SELECT j.packet_id, j.kind, j.account_id, j.amount, p.sender_id FROM journal j"
            " JOIN red_packets p ON p.id = j.packet_id"
            " WHERE j.kind IN ('send', 'refund') AND j.account_id <> p.sender_id",
            (),
        ),
        "unmatched": (
            "SELECT j.packet_id, j.account_id, j.amount FROM journal j"
            " LEFT JOIN grab_records g ON g.packet_id = j.packet_id AND g.user_id = j.account_id"
            f" AND g.amount = j.amount AND g.status IN ('{RecordStatus.CREDITED}',"
            f" '{RecordStatus.CREDITING}') AND j.idem_key = {grab_key}"
            " WHERE j.kind = 'grab' AND g.id IS NULL",
            (),
        ),
        "unposted": (
            "SELECT g.packet_id, g.user_id, g.seq, g.amount FROM grab_records g"
            f" LEFT JOIN journal j ON j.idem_key = {grab_key} AND j.account_id = g.user_id"
            " AND j.amount = g.amount"
            f" WHERE g.status = '{RecordStatus.CREDITED}' AND j.id IS NULL",
            (),
        ),
        # A shard-local credit between its steps (server.money.shardsteps): posted or not yet.
        "crediting": (
            "SELECT g.packet_id, g.user_id, g.seq, g.amount, g.grabbed_ms, COUNT(j.id) FROM grab_records g"
            f" LEFT JOIN journal j ON j.idem_key = {grab_key} AND j.account_id = g.user_id"
            f" WHERE g.status = '{RecordStatus.CREDITING}' GROUP BY g.packet_id, g.user_id, g.seq,"
            " g.amount, g.grabbed_ms",
            (),
        ),
        "off_share": (
            "SELECT g.packet_id, g.user_id, g.seq, g.amount, COALESCE(s.amount, 0) FROM grab_records g"
            " LEFT JOIN red_packet_shares s ON s.packet_id = g.packet_id AND s.seq = g.seq"
            " WHERE s.amount IS NULL OR s.amount <> g.amount",
            (),
        ),
        "refused": (
            "SELECT r.packet_id, r.user_id, r.seq, r.amount, r.code, r.refused_by FROM credit_refusals r"
            " LEFT JOIN grab_records g ON g.packet_id = r.packet_id AND g.user_id = r.user_id"
            f" AND g.seq = r.seq AND g.status = '{RecordStatus.CREDITED}'"
            " WHERE g.id IS NULL",
            (),
        ),
        "repeated": (
            "SELECT tx, COUNT(*) FROM journal"
            " WHERE kind IN ('send', 'topup', 'refund', 'withdraw', 'hold', 'release') AND tx IS NOT NULL"
            " GROUP BY tx HAVING COUNT(*) > 1",
            (),
        ),
        "compared": (
            "SELECT g.packet_id, g.user_id, g.seq, g.amount FROM grab_records g"
            " JOIN red_packets p ON p.id = g.packet_id"
            f" WHERE p.status IN ('{PacketStatus.ACTIVE}', '{PacketStatus.REFUNDING}') OR (p.status ="
            f" '{PacketStatus.FINISHED}' AND p.finished_ms >= %s)",
            (now - RECENT_MS,),
        ),
    }
