"""What the ledger holds of one packet and of one account, read for the operators' console
(``server.hub.console``): rows as they are, nothing decided here but their shape."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from server.ids import GroupId, PacketId, UserId
from server.store.db import Database, as_text
from server.store.shards import server_name


@dataclass(frozen=True)
class PacketRows:
    records: dict[int, tuple[str, int | None]]  # share seq → the grab record's status, when it was credited
    refusals: dict[int, dict[str, Any]]  # share seq → the refused credit and why
    journal: list[dict[str, Any]]  # every journal row of the packet, oldest first (with its ``tx``)


async def packet_rows(db: Database, packet_id: PacketId) -> PacketRows:
    records = {
        int(r[0]): (str(r[1]), None if r[2] is None else int(r[2]))
        for r in await db.fetchall(
            "SELECT seq, status, credited_ms FROM grab_records WHERE packet_id = %s", (packet_id,)
        )
    }
    refusals = {
        int(r[0]): {
            "user_id": int(r[1]),
            "seq": int(r[0]),
            "amount": int(r[2]),
            "grabbed_ms": int(r[3]),
            "code": str(r[4]),
            "refused_by": str(r[5]),
            "ms": int(r[6]),
        }
        for r in await db.fetchall(
            "SELECT seq, user_id, amount, grabbed_ms, code, refused_by, refused_ms FROM credit_refusals"
            " WHERE packet_id = %s ORDER BY seq",
            (packet_id,),
        )
    }
    journal = [
        {
            "id": int(r[0]),
            "user_id": int(r[1]),
            "amount": int(r[2]),
            "kind": str(r[3]),
            "key": as_text(r[4]),
            "created_ms": int(r[5]),
            "tx": None if r[6] is None else int(r[6]),
        }
        for r in await db.fetchall(
            "SELECT id, account_id, amount, kind, idem_key, created_ms, tx FROM journal WHERE packet_id = %s"
            " ORDER BY id",
            (packet_id,),
        )
    ]
    return PacketRows(records, refusals, journal)


@dataclass(frozen=True)
class AccountRows:
    balance: int
    rows: int  # journal rows in all
    total: int  # their sum
    newest: list[dict[str, Any]]  # the newest journal rows, newest first, each with the balance after it
    holds: list[dict[str, Any]]  # the newest holds, newest first
    groups: list[GroupId]  # some of the groups the user is in


async def account_rows(db: Database, user_id: UserId, newest: int, groups: int) -> AccountRows:
    """The account's balance and journal (its ``newest`` rows, each with the balance after it, counted
    back from the balance), read in one snapshot (a credit landing meanwhile shows in all or none), its
    newest holds, and up to ``groups`` of its groups."""
    async with db.snapshot() as tx:
        found = await tx.fetchone("SELECT balance FROM accounts WHERE user_id = %s", (user_id,))
        rows = await tx.fetchall(
            "SELECT id, amount, kind, idem_key, packet_id, created_ms FROM journal WHERE account_id = %s"
            " ORDER BY id DESC LIMIT %s",
            (user_id, newest),
        )
        total = await tx.fetchone(
            "SELECT COUNT(*), COALESCE(SUM(amount), 0) FROM journal WHERE account_id = %s", (user_id,)
        )
    balance = int(found[0]) if found else 0
    after, journal = balance, []
    for r in rows:  # newest first: the balance after a row is the one after the next newer, less it
        journal.append(
            {
                "id": int(r[0]),
                "amount": int(r[1]),
                "kind": str(r[2]),
                "key": as_text(r[3]),
                "packet_id": None if r[4] is None else int(r[4]),
                "created_ms": int(r[5]),
                "balance_after": after,
            }
        )
        after -= int(r[1])
    holds = [
        {
            "request_id": as_text(r[0]),
            "amount": int(r[1]),
            "state": str(r[2]),
            "created_ms": int(r[3]),
            "expires_ms": int(r[4]),
            "closed_ms": None if r[5] is None else int(r[5]),
        }
        for r in await db.fetchall(
            "SELECT request_id, amount, state, created_ms, expires_ms, closed_ms FROM holds"
            " WHERE user_id = %s ORDER BY created_ms DESC LIMIT %s",
            (user_id, newest),
        )
    ]
    member_of = await db.fetchall(
        "SELECT group_id FROM group_members WHERE user_id = %s LIMIT %s", (user_id, groups)
    )
    return AccountRows(
        balance,
        int(total[0]) if total else 0,
        int(total[1]) if total else 0,
        journal,
        holds,
        [GroupId(int(g[0])) for g in member_of],
    )


async def writer_recorded(db: Database) -> dict[str, Any] | None:
    """The database node the deployment's processes were told to write through (``db_writer``)."""
    row = await db.fetchone("SELECT address, set_ms FROM db_writer WHERE id = 1")
    return None if row is None else {"address": as_text(row[0]), "set_ms": int(row[1])}


async def backends(db: Database) -> list[dict[str, Any]]:
    """A sharded ledger's backends as its Spider head knows them, shard by shard."""
    name = as_text((await db.fetchone("SELECT DATABASE()") or [""])[0])
    names = [server_name(name, i) for i in range(db.shards)]
    if not names:
        return []
    rows = await db.fetchall(
        "SELECT Server_name, Host, Port, Db FROM mysql.servers"
        f" WHERE Server_name IN ({', '.join(['%s'] * len(names))})",
        names,
    )
    found = {as_text(r[0]): f"{as_text(r[1])}:{int(r[2])}/{as_text(r[3])}" for r in rows}
    return [{"shard": i, "server": found.get(n)} for i, n in enumerate(names)]
