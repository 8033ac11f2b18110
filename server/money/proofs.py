"""A packet's proof of a fair split, checked as any member checks it and against what the ledger stored:
one check, shown by ``redpacket verify`` and by the operators' console."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from redpacket_client import fairness
from server.core import Core
from server.ids import PacketId
from server.money import grabs
from server.money.grabs import view_dict
from server.money.packetrows import Packet
from server.money.packets import load_packet


@dataclass(frozen=True)
class Proof:
    packet: Packet
    view: dict[str, Any]  # the packet as ``open`` shows it to any member (``view_dict``)
    verdict: fairness.Verdict
    # Where the shares the database stored differ from those its seed draws (before the packet is revealed,
    # only which: their amounts are the shares still to come).
    wrong: list[str]

    @property
    def exit_code(self) -> int:
        """``redpacket verify``'s: 0 verified, 1 a mismatch, 3 nothing to check."""
        if self.wrong or self.verdict.status == "mismatch":
            return 1
        return 0 if self.verdict.status == "verified" else 3


async def check(core: Core, packet_id: PacketId, published: str | None = None) -> Proof | None:
    """The proof of ``packet_id`` (None: no such packet), against ``published`` when given (a commitment
    kept from before the seed was shown)."""
    packet = await load_packet(core, packet_id)
    if packet is None:
        return None
    view = view_dict(
        await grabs.open_packet(core, packet_id=packet_id, group_id=packet.group_id, user_id=None)
    )
    rows = await core.db.fetchall(
        "SELECT amount FROM red_packet_shares WHERE packet_id = %s ORDER BY seq", (packet_id,)
    )
    verdict = fairness.verify(view, published)
    stored = [int(r[0]) for r in rows]
    drawn = packet.shares() if packet.seed is not None else stored
    secret = verdict.status == "not_revealed"
    wrong = [
        f"stored share {i} differs from the one drawn"
        if secret
        else f"stored share {i} is {a} cents; drawn {b}"
        for i, (a, b) in enumerate(zip(stored, drawn, strict=False), 1)
        if a != b
    ]
    if len(stored) != len(drawn):
        wrong.append(f"{len(stored)} shares stored; {len(drawn)} drawn")
    return Proof(packet, view, verdict, wrong)
