"""What a reconciliation found, and how it is shown: the differences, the overall figures and those of each
shard of a sharded ledger (``server.money.reconcile`` finds them). Pure."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field, replace

from server.store.shards import shard_of


@dataclass(frozen=True)
class Difference:
    check: str
    subject: str
    expected: int
    actual: int

    def __str__(self) -> str:
        return f"{self.check} {self.subject}: expected {self.expected}, found {self.actual}"


@dataclass(frozen=True)
class Report:
    differences: list[Difference]
    packets: int
    accounts: int
    money_in: int
    in_balances: int
    held_in_packets: int
    paid_out: int = 0
    # A sharded ledger's figures, a line per shard (``per_shard``).
    shards: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.differences

    def checks(self) -> set[str]:
        """The names of the checks that found a difference."""
        return {d.check for d in self.differences}


def confirmed(first: Report, second: Report) -> Report:
    """``second`` with only the differences ``first`` found too (two reads of a sharded ledger: one
    caught between the steps of a money move shows in one of them only). Matched by check, subject and
    how far off: a balance or the global sum off by a cent stays off by it while money moves between
    the reads, though both sides of it change."""
    seen = {_gap(d) for d in first.differences}
    return replace(second, differences=[d for d in second.differences if _gap(d) in seen])


def _gap(d: Difference) -> tuple[str, str, int]:
    return d.check, d.subject, d.actual - d.expected


SUBJECT = re.compile(r"(packet|account) (\d+)")


def per_shard(
    held: list[tuple[int, int]], balances: list[tuple[int, int]], report: Report, shards: int
) -> list[str]:
    """A line per shard: its packets and what they hold (``held``: packet, outstanding), its accounts
    and their balances (``balances``: user, balance), and the differences about its packets or
    accounts."""
    if not shards:
        return []
    lines = []
    about = [m for d in report.differences if (m := SUBJECT.match(d.subject))]
    for k in range(shards):
        packets = [h for p, h in held if shard_of(p, shards) == k]
        accounts = [b for u, b in balances if shard_of(u, shards) == k]
        found = sum(1 for m in about if shard_of(int(m.group(2)), shards) == k)
        lines.append(
            f"shard {k}: packets {len(packets)} holding {sum(packets)},"
            f" accounts {len(accounts)} holding {sum(accounts)}, differences {found}"
        )
    return lines


def render(report: Report) -> str:
    held, balances = report.held_in_packets, report.in_balances
    out = report.paid_out
    verdict = "ok" if report.money_in == balances + held + out else "MISMATCH"
    lines = [
        f"packets {report.packets}, accounts {report.accounts}",
        f"money in {report.money_in} = in balances {balances} + held in packets {held}"
        f" + paid out {out} ({verdict})",
    ]
    lines += report.shards
    lines += [f"DIFFERENCE {d}" for d in report.differences]
    lines.append("reconciled: no difference" if report.ok else f"{len(report.differences)} difference(s)")
    return "\n".join(lines)


def to_json(report: Report) -> str:
    """``report`` as one JSON object (``redpacket reconcile --json``): its figures, ``ok``, and each
    difference as ``{"check", "subject", "expected", "actual"}``. ``from_json`` reads it back."""
    return json.dumps({"ok": report.ok, **asdict(report)})


def from_json(text: str | bytes) -> Report:
    """The report ``to_json`` wrote; ``ValueError`` for anything else."""
    try:
        figures = json.loads(text)
        figures.pop("ok")
        figures["differences"] = [Difference(**d) for d in figures["differences"]]
        return Report(**figures)
    except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as e:
        raise ValueError(f"not a reconciliation report: {e!r}") from None
