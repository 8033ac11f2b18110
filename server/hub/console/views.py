"""What the console shows of one packet and of one user, read from the ledger and Redis as they stand.

A packet: its row, every grab in grab order with what became of its credit (``CreditState``), its refund,
its journal rows, its events and their webhook deliveries, and its proof of a fair split checked on the
spot (``server.money.proofs``). A user: balance, the journal newest first with the balance after each row,
holds, blocks and throttles, and sockets online."""

from __future__ import annotations

from typing import Any, Literal

from server.core import Core
from server.ids import GroupId, PacketId, ShareSeq, UserId
from server.live import bots
from server.money import casefiles, deliveries, events, ledger, proofs
from server.money.endpoints import configured
from server.money.events import grab_key
from server.money.statuses import RecordStatus
from server.store import keys
from server.store.db import as_text

# What became of a grab's credit: paid (its journal row is written), refused for good (``credit_refusals``:
# its code and who refused it), half-way on a sharded ledger (``crediting``), or still in its shard's
# outbox in Redis (told "won", a worker has not paid it yet).
CreditState = Literal["paid", "refused", "crediting", "outbox"]

JOURNAL_ROWS = 200  # the newest rows of a user's journal the console shows
GROUPS_LOOKED_AT = 50  # the user's groups whose presence says which hubs hold their sockets


async def packet(core: Core, packet_id: PacketId) -> dict[str, Any] | None:
    proof = await proofs.check(core, packet_id)
    if proof is None:
        return None
    p, view, db = proof.packet, proof.view, core.db
    rows = await casefiles.packet_rows(db, packet_id)
    records, refused, journal = rows.records, rows.refusals, rows.journal
    paid = {j["key"]: j for j in journal if j["kind"] == "grab"}
    shown = [_grab(g, packet_id, paid, records, refused) for g in view["grabs"]]
    seen = {g["seq"] for g in shown}
    shown += [_refused_only(r) for seq, r in refused.items() if seq not in seen]
    found = await events.of_packet(
        db,
        packet_id,
        [j["key"] for j in journal if j["kind"] != "grab"] + [ledger.finished_key(packet_id)],
        sorted({j["tx"] for j in journal if j["kind"] == "grab" and j["tx"] is not None}),
    )
    refund = next((j for j in journal if j["kind"] == "refund"), None)
    return {
        "packet_id": p.packet_id,
        "sender_id": p.sender_id,
        "group_id": p.group_id,
        "kind": p.kind,
        "total": p.total,
        "count": p.count,
        "greeting": p.greeting,
        "target": p.target_user_id,
        "status": str(p.status),
        "created_ms": p.created_ms,
        "expires_ms": p.expires_ms,
        "finished_ms": p.finished_ms,
        "remaining": view["remaining"],
        "grabs": shown,
        "paid": sum(g["amount"] for g in shown if g["credit"] == "paid"),
        "refund": None
        if refund is None
        else {"amount": refund["amount"], "created_ms": refund["created_ms"]},
        "journal": [{k: v for k, v in j.items() if k != "tx"} for j in journal],  # (tx: internal, 63 bits)
        "events": [{"id": e["id"], "type": e["type"], "created_ms": e["created_ms"]} for e in found],
        "deliveries": await _deliveries(core, [e["id"] for e in found]),
        "fairness": {
            "status": proof.verdict.status,
            "said": str(proof.verdict),
            "problems": proof.verdict.problems + proof.wrong,
            "commitment": view["commitment"],
            "seed": view["seed"],
            "shares": proof.verdict.shares,
        },
    }


def _grab(
    g: dict[str, Any],
    packet_id: PacketId,
    paid: dict[str, dict[str, Any]],
    records: dict[int, tuple[str, int | None]],
    refused: dict[int, dict[str, Any]],
) -> dict[str, Any]:
    seq = int(g["seq"])
    row = paid.get(grab_key(packet_id, ShareSeq(seq)))
    credit: CreditState
    if row is not None and row["user_id"] == g["user_id"]:
        credit = "paid"
    elif seq in refused:
        credit = "refused"
    elif seq in records and records[seq][0] == RecordStatus.CREDITING:
        credit = "crediting"
    else:
        credit = "outbox"
    r = refused.get(seq)
    return {
        **g,
        "credit": credit,
        "credited_ms": None if row is None else row["created_ms"],
        "refusal": None if r is None else _why(r),
    }


def _why(r: dict[str, Any]) -> dict[str, Any]:
    return {"code": r["code"], "refused_by": r["refused_by"], "ms": r["ms"]}


def _refused_only(r: dict[str, Any]) -> dict[str, Any]:
    """A refused credit the packet's grabs do not list (a share the ledger says is another's)."""
    fields = ("user_id", "seq", "amount", "grabbed_ms")
    return {**{k: r[k] for k in fields}, "credit": "refused", "credited_ms": None, "refusal": _why(r)}


async def _deliveries(core: Core, seqs: list[int]) -> list[dict[str, Any]]:
    out = []
    for e in configured(core.settings):
        for d in await deliveries.of_events(core.db, e.id, seqs):
            out.append({"endpoint": e.label, "endpoint_id": e.id, **d})
    return out


async def user(core: Core, user_id: UserId, sockets_here: int, hub_id: str) -> dict[str, Any] | None:
    db = core.db
    name = await ledger.user_name(db, user_id)
    if name is None:
        return None
    rows = await casefiles.account_rows(db, user_id, JOURNAL_ROWS, GROUPS_LOOKED_AT)
    restrictions = [
        {"action": b.action, "until_ms": b.until_ms, "reasons": b.reasons}
        for b in await bots.list_blocks(core)
        if b.user == user_id
    ]
    return {
        "user_id": user_id,
        "name": name,
        "balance": rows.balance,
        "journal_rows": rows.rows,
        "journal_sum": rows.total,
        "journal": rows.newest,
        "holds": rows.holds,
        "restrictions": restrictions,
        "sockets_here": sockets_here,
        "hubs_online": await _hubs_online(core, user_id, rows.groups, hub_id if sockets_here else None),
    }


async def _hubs_online(core: Core, user_id: UserId, groups: list[GroupId], here: str | None) -> list[str]:
    """The hubs whose presence in these groups of the user's says they hold a socket of the user now."""
    now = ledger.now_ms()
    hubs = {here} if here else set()
    async with core.redis.pipeline(transaction=False) as pipe:
        for g in groups:
            pipe.hgetall(keys.presence_hubs(group_id=g, user_id=user_id))
        held: list[dict[bytes, bytes]] = await pipe.execute()
    for each in held:
        hubs |= {as_text(h) for h, lapse in each.items() if int(lapse) > now}
    return sorted(hubs)
