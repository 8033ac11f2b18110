"""Provably fair packets: the split drawn from a committed seed, and the check anyone can make of it.

At send the server draws a 32-byte seed and publishes only its commitment, ``sha256(seed)``; every share
is drawn from the seed by a deterministic generator (HMAC-SHA-256 in counter mode). Once the packet is
finished or refunded the seed is shown, and from the seed, the packet's id, kind, total and count anyone
recomputes the shares in order and checks that the i-th grab of the packet's grab list got the i-th.
docs/protocol.md ("Provably fair packets") specifies all of it, with test vectors; the JavaScript client
(clients/js) implements the same. The hub draws every packet's shares with this module too (its money
core validates the request first): the split a client checks is the one the server made, by
construction. Pure: no I/O.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

SEED_BYTES = 32
# Named in every block's message: a later generator gets another name, never another meaning of this one.
VERSION = "redpacket/split/v1"
_WORD = 2**64
_FOUR_WORDS = struct.Struct(">4Q")
_HEX64 = re.compile(r"[0-9a-f]{64}")
# A uniform integer in [0, n), n ≥ 1.
Below = Callable[[int], int]
# The kinds of packet, each split its own way (``split``); the hub refuses any other at send.
Kind = Literal["lucky", "equal", "exclusive"]
KINDS: tuple[Kind, ...] = ("lucky", "equal", "exclusive")


def commitment(seed: bytes) -> str:
    """The commitment published at send: SHA-256 of the seed's 32 bytes, in lowercase hex."""
    return hashlib.sha256(seed).hexdigest()


class Stream:
    """The generator: block j is HMAC-SHA-256(key=seed, message="<VERSION>/<packet>/<total>/<count>/<j>"),
    read as four unsigned 64-bit big-endian words, used in order."""

    def __init__(self, seed: bytes, packet_id: int, total: int, count: int) -> None:
        self.key = seed
        self.prefix = f"{VERSION}/{packet_id}/{total}/{count}/"
        self.block = 0
        self.words: list[int] = []

    def word(self) -> int:
        if not self.words:
            digest = hmac.digest(self.key, f"{self.prefix}{self.block}".encode("ascii"), "sha256")
            self.block += 1
            self.words = list(_FOUR_WORDS.unpack(digest))
            self.words.reverse()  # popped from the end: bytes 0–7 first
        return self.words.pop()

    def below(self, n: int) -> int:
        """A uniform integer in [0, n): the next word w below the largest multiple of n under 2^64 (words
        at or above it are skipped), taken modulo n."""
        limit = _WORD - _WORD % n
        while True:
            w = self.word()
            if w < limit:
                return w % n


def double_average(total: int, count: int, below: Below) -> list[int]:
    """Draw shares in order by the double-average method.

    Each draw is uniform in [1, min(2 × remaining average, remaining − cents owed to the rest)], so
    every share is at least one cent and at most twice the average of what is left; the last share
    takes the remainder. The draws sum to ``total`` exactly.
    """
    if count < 1 or total < count:
        raise ValueError(f"{total} cents cannot make {count} shares of at least one cent")
    shares: list[int] = []
    remaining = total
    for left in range(count, 1, -1):
        upper = min(2 * remaining // left, remaining - (left - 1))
        amount = 1 + below(upper)
        shares.append(amount)
        remaining -= amount
    shares.append(remaining)
    return shares


def shuffle(items: list[int], below: Below) -> None:
    """Fisher–Yates, in place: for i from the last index down to 1, swap item i with item ``below(i + 1)``."""
    for i in range(len(items) - 1, 0, -1):
        j = below(i + 1)
        items[i], items[j] = items[j], items[i]


def split(kind: str, total: int, count: int, below: Below) -> list[int]:
    """The shares of a packet, in the order they will be handed out (the request already valid: ``kind``
    lucky, equal or exclusive, 1 ≤ count ≤ total, an equal packet's total a multiple of its count)."""
    if kind == "lucky":
        shares = double_average(total, count, below)
        # Later draws of the double-average method spread wider; shuffling makes the grab order fair.
        shuffle(shares, below)
        return shares
    if kind == "equal":
        return [total // count] * count
    return [total]


def fair_shares(seed: bytes, packet_id: int, kind: str, total: int, count: int) -> list[int]:
    """The shares of a packet, in the order they are handed out (share ``seq`` is item ``seq - 1``)."""
    return split(kind, total, count, Stream(seed, packet_id, total, count).below)


Status = Literal["verified", "mismatch", "not_verifiable", "not_revealed"]


@dataclass(frozen=True)
class Verdict:
    """What ``verify`` found: ``verified`` (every grab got its drawn share, in order), ``mismatch`` (each
    fault in ``problems``), ``not_verifiable`` (sent before packets were provably fair: no commitment)
    or ``not_revealed`` (still active: the seed is shown when it is finished or refunded).
    ``against_send``: the commitment was checked against the one published at send, kept by the
    checker; without it, a seed chosen after the grabs (with a commitment made to match) goes unseen."""

    status: Status
    problems: list[str] = field(default_factory=list)
    shares: list[int] = field(default_factory=list)
    against_send: bool = False

    def __str__(self) -> str:
        if self.status == "verified":
            if self.against_send:
                return "verified"
            return (
                "verified against the commitment the view shows (compare it with the one published at send)"
            )
        if self.status == "not_verifiable":
            return "not verifiable: sent before packets were provably fair (no commitment)"
        if self.status == "not_revealed":
            return "not revealed yet: the seed is shown once the packet is finished or refunded"
        return "mismatch:\n" + "\n".join(f"  {p}" for p in self.problems)


def verify(view: Mapping[str, Any], published: str | None = None) -> Verdict:
    """Check a packet view as the protocol sends it (``open``, ``GET /api/packets/{p}``): the seed against
    the commitment, and that against ``published`` — the commitment the checker kept from before the seed
    was shown (the send reply, the ``packet`` event, a view of the packet while active) —, then each grab,
    in the order listed, against the share drawn for it."""
    committed, seed_hex = view.get("commitment"), view.get("seed")
    if committed is None and published is None:
        return Verdict("not_verifiable")
    if committed is not None and seed_hex is None:
        return Verdict("not_revealed")
    problems = []
    if published is not None and committed != published:
        shown = "null" if committed is None else committed  # (as the protocol writes a missing one)
        problems.append(f"the commitment shown now is {shown}; the one published at send was {published}")
    if not isinstance(seed_hex, str) or not _HEX64.fullmatch(seed_hex):
        problems.append("the seed is not 64 lowercase hex digits")
        return Verdict("mismatch", problems, [], published is not None)
    seed = bytes.fromhex(seed_hex)
    if commitment(seed) != committed:
        problems.append(f"sha256(seed) is {commitment(seed)}, not the commitment {committed}")
    kind, total, count = str(view["kind"]), int(view["total"]), int(view["count"])
    impossible = _impossible(kind, total, count)
    if impossible:  # (no split makes it: a view no hub sends, and no loop of a billion draws either)
        return Verdict("mismatch", [*problems, impossible], [], published is not None)
    shares = fair_shares(seed, int(view["packet_id"]), kind, total, count)
    problems += _grab_problems(view["grabs"], shares)
    return Verdict("mismatch" if problems else "verified", problems, shares, published is not None)


# The most shares a packet can have under any hub's settings (docs/protocol.md: `count`, 1 to
# REDPACKET_MAX_COUNT, at most the group's members): far above any deployment's, far below a count that
# would keep a checker drawing for minutes.
MOST_SHARES = 100_000


def _impossible(kind: str, total: int, count: int) -> str | None:
    """Why no packet has this kind, total and count, if none has."""
    if kind not in KINDS:
        return f"the kind {kind!r} is none of {', '.join(KINDS)}"
    if not 1 <= count <= min(total, MOST_SHARES):
        return f"{count} shares of {total} cents: a packet has 1 to {MOST_SHARES} shares of a cent or more"
    if (kind == "equal" and total % count) or (kind == "exclusive" and count != 1):
        return f"{count} shares of {total} cents cannot make an {kind} packet"
    return None


def _grab_problems(grabs: Sequence[Mapping[str, Any]], shares: list[int]) -> list[str]:
    """Going down the list: each grab's share is one of the packet's, not listed before, numbered above
    every share listed before it (handed out in the order drawn; a number skipped was not grabbed, or its
    credit was refused), and its amount is that share's."""
    n = len(shares)
    problems = [f"{len(grabs)} grabs of a packet of {n} shares"] if len(grabs) > n else []
    last = 0
    seen: set[int] = set()
    for i, g in enumerate(grabs, start=1):
        user, seq, amount = g["user_id"], int(g["seq"]), int(g["amount"])
        if not 1 <= seq <= n:
            problems.append(f"grab {i} (user {user}) got share {seq}: the packet has shares 1 to {n}")
            continue
        if seq in seen:
            problems.append(f"grab {i} (user {user}) got share {seq}, listed before")
        elif seq < last:
            problems.append(
                f"grab {i} (user {user}) got share {seq} after share {last}:"
                " not handed out in the order drawn"
            )
        if amount != shares[seq - 1]:
            problems.append(f"grab {i} (user {user}) got {amount} cents; share {seq} is {shares[seq - 1]}")
        seen.add(seq)
        last = max(last, seq)
    return problems
