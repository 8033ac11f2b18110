"""Provably fair packets, the pure part: the generator and split against the test vectors of
docs/protocol.md, and ``verify`` catching every kind of tamper (the split's statistics over 10^5 packets:
``tests/test_fairness_statistics.py``, out of the fast tier)."""

from __future__ import annotations

import copy
import hashlib
import hmac
import itertools
import json
import re
from pathlib import Path
from typing import Any

import pytest

from redpacket_client import fairness
from redpacket_client.fairness import Stream, commitment, fair_shares, verify
from server.ids import GroupId, PacketId, ShareSeq, UserId
from server.money.grabs import Grab, view_packet

PROTOCOL = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


def doc_json_after(heading: str) -> Any:
    """The first ```json block after ``heading`` in docs/protocol.md."""
    text = PROTOCOL.read_text()
    start = text.index(heading)
    block = re.search(r"```json\n(.*?)\n```", text[start:], re.S)
    assert block is not None, f"no json block after {heading!r}"
    return json.loads(block.group(1))


VECTORS: list[dict[str, Any]] = doc_json_after("### Test vectors")


def test_the_document_has_vectors_of_every_kind_and_edge() -> None:
    kinds = {v["kind"] for v in VECTORS}
    assert kinds == {"lucky", "equal", "exclusive"}
    assert any(v["count"] == v["total"] for v in VECTORS)  # every share exactly one cent
    assert any(v["packet_id"] == 2**63 - 1 for v in VECTORS)  # the largest id, past JavaScript's 2^53
    assert any(v["count"] == 100 for v in VECTORS)


@pytest.mark.parametrize("v", VECTORS, ids=lambda v: f"{v['kind']}-{v['packet_id']}")
def test_vector(v: dict[str, Any]) -> None:
    seed = bytes.fromhex(v["seed"])
    assert commitment(seed) == v["commitment"]
    message = f"redpacket/split/v1/{v['packet_id']}/{v['total']}/{v['count']}/0".encode()
    assert hmac.digest(seed, message, "sha256").hex() == v["block0"]
    shares = fair_shares(seed, v["packet_id"], v["kind"], v["total"], v["count"])
    assert shares == v["shares"]
    assert sum(shares) == v["total"] and min(shares) >= 1 and len(shares) == v["count"]


def test_words_are_read_big_endian_in_block_order() -> None:
    seed = bytes(range(32))
    s = Stream(seed, 1, 888, 2)
    blocks = [hmac.digest(seed, f"redpacket/split/v1/1/888/2/{j}".encode(), "sha256") for j in (0, 1)]
    want = [int.from_bytes(b[i : i + 8], "big") for b in blocks for i in (0, 8, 16, 24)]
    assert [s.word() for _ in range(8)] == want


def test_below_skips_the_words_that_would_bias_it() -> None:
    s = Stream(bytes(32), 1, 1, 1)
    n = 3 * 2**62  # the limit is 3·2^62: a quarter of all words lies at or above it
    words = [2**64 - 1, 3 * 2**62, 5, 3 * 2**62 - 1]
    s.words = list(reversed(words))
    assert s.below(n) == 5  # the first two skipped
    assert s.below(n) == 3 * 2**62 - 1
    s.words = [2**64 - 1]
    assert s.below(1) == 0  # n = 1: every word is below 2^64, and the answer is 0


def test_the_seed_the_id_the_total_and_the_count_all_change_the_split() -> None:
    seed = hashlib.sha256(b"s").digest()
    base = fair_shares(seed, 5, "lucky", 10_000, 20)
    assert fair_shares(seed, 5, "lucky", 10_000, 20) == base  # deterministic
    assert fair_shares(hashlib.sha256(b"t").digest(), 5, "lucky", 10_000, 20) != base
    assert fair_shares(seed, 6, "lucky", 10_000, 20) != base
    assert fair_shares(seed, 5, "lucky", 10_001, 20) != base
    assert fair_shares(seed, 5, "lucky", 10_000, 19)[:5] != base[:5]


# The example packet view of docs/protocol.md: a finished packet, with its proof.
EXAMPLE: dict[str, Any] = doc_json_after("**The packet view**")


def test_the_documents_example_view_verifies() -> None:
    v = verify(EXAMPLE, EXAMPLE["commitment"])
    assert v.status == "verified" and str(v) == "verified"
    assert v.shares == [g["amount"] for g in EXAMPLE["grabs"]]


def _tampered(change: str) -> dict[str, Any]:
    view = copy.deepcopy(EXAMPLE)
    g = view["grabs"]
    if change == "amount":
        g[0]["amount"] += 1
        g[1]["amount"] -= 1  # still summing to the total: only the draw can tell
    elif change == "order":
        g[0]["seq"], g[1]["seq"] = g[1]["seq"], g[0]["seq"]
        g[0]["amount"], g[1]["amount"] = g[1]["amount"], g[0]["amount"]  # the big share first
    elif change == "seed":
        view["seed"] = hashlib.sha256(b"another").hexdigest()
    elif change == "commitment":
        view["commitment"] = hashlib.sha256(b"another").hexdigest()
    elif change == "total":
        view["total"] += 1
    elif change == "extra":
        g.append({"user_id": 9, "seq": 3, "amount": 1, "grabbed_ms": 1796000001300})
    elif change == "malformed":
        view["seed"] = view["seed"].upper()
    elif change == "duplicate":
        g[1]["seq"], g[1]["amount"] = 1, 53
    elif change == "out of range":
        g[1]["seq"] = 3
    return view


CHANGES = [
    "amount",
    "order",
    "seed",
    "commitment",
    "total",
    "extra",
    "malformed",
    "duplicate",
    "out of range",
]


@pytest.mark.parametrize("change", CHANGES)
def test_every_tamper_is_a_mismatch_that_says_what(change: str) -> None:
    v = verify(_tampered(change), EXAMPLE["commitment"])
    assert v.status == "mismatch"
    assert v.problems and str(v).startswith("mismatch:")
    expected = {
        "amount": "got 54 cents; share 1 is 53",
        "order": "grab 2 (user 7) got share 1 after share 2: not handed out in the order drawn",
        "seed": "sha256(seed) is",
        "commitment": "the commitment shown now is",
        "total": "grab 1",
        "extra": "3 grabs of a packet of 2 shares",
        "malformed": "not 64 lowercase hex digits",
        "duplicate": "grab 2 (user 7) got share 1, listed before",
        "out of range": "grab 2 (user 7) got share 3: the packet has shares 1 to 2",
    }[change]
    assert any(expected in p for p in v.problems), v.problems


def test_a_seed_chosen_after_the_grabs_is_caught_only_by_the_commitment_kept_from_the_send() -> None:
    # A rigged server wants the first grabber (user 8) to have the big share: it tries seeds until the
    # split gives it, and shows that seed with a commitment made to match.
    rigged = copy.deepcopy(EXAMPLE)
    for i in itertools.count():
        seed = hashlib.sha256(i.to_bytes(8, "big")).digest()
        shares = fair_shares(seed, 1, "lucky", 888, 2)
        if shares[0] > 800:
            break
    rigged["seed"], rigged["commitment"] = seed.hex(), commitment(seed)
    for g, amount in zip(rigged["grabs"], shares, strict=True):
        g["amount"] = amount
    alone = verify(rigged)  # against its own commitment only: nothing to see
    assert alone.status == "verified" and not alone.against_send
    assert "compare it with the one published at send" in str(alone)
    kept = verify(rigged, EXAMPLE["commitment"])
    assert kept.status == "mismatch" and kept.problems[0].startswith("the commitment shown now is")
    honest = verify(EXAMPLE, EXAMPLE["commitment"])
    assert honest.status == "verified" and honest.against_send and str(honest) == "verified"


def test_a_share_not_listed_is_no_fault_and_one_listed_out_of_order_is() -> None:
    seed = bytes.fromhex(VECTORS[3]["seed"])
    shares = fair_shares(seed, 123456789, "lucky", 100, 7)
    view = {"packet_id": 123456789, "kind": "lucky", "total": 100, "count": 7, "seed": seed.hex()}
    view["commitment"] = commitment(seed)
    # Shares 2 and 5 not listed: refunded, or their credits refused.
    listed = [1, 3, 4, 6, 7]
    view["grabs"] = [{"user_id": 10 + s, "seq": s, "amount": shares[s - 1]} for s in listed]
    assert verify(view, view["commitment"]).status == "verified"
    view["grabs"][1], view["grabs"][2] = view["grabs"][2], view["grabs"][1]
    v = verify(view, view["commitment"])
    assert v.problems == ["grab 3 (user 13) got share 3 after share 4: not handed out in the order drawn"]


def test_a_packet_without_a_commitment_is_not_verifiable_and_an_active_one_not_revealed() -> None:
    legacy = {**EXAMPLE, "commitment": None, "seed": None}
    assert verify(legacy).status == "not_verifiable"
    assert "not verifiable" in str(verify(legacy))
    active = {**EXAMPLE, "seed": None, "grabs": EXAMPLE["grabs"][:1]}
    assert verify(active).status == "not_revealed"
    # A commitment kept from the send, and a view that no longer shows one: not "not verifiable".
    assert verify(legacy, EXAMPLE["commitment"]).status == "mismatch"


def _meta(seed: bytes | None, **more: str) -> dict[str, str]:
    meta = {"group": "1", "sender": "7", "kind": "lucky", "total": "888", "count": "2", "created_ms": "1"}
    meta |= {"expires_ms": "2", **more}
    if seed is not None:
        meta["seed"] = seed.hex()
    return meta


def test_a_view_shows_the_seed_only_once_no_grab_can_come() -> None:
    seed = bytes(range(32))
    one = {UserId(8): Grab(UserId(8), ShareSeq(1), 53, 10)}
    two = one | {UserId(7): Grab(UserId(7), ShareSeq(2), 835, 20)}
    pid = PacketId(1)
    active = view_packet(_meta(seed), one, 1, packet_id=pid, user_id=UserId(8))
    assert active.commitment == commitment(seed) and active.seed is None
    finished = view_packet(_meta(seed), two, 0, packet_id=pid, user_id=UserId(8))
    assert finished.seed == seed.hex()
    closed = view_packet(_meta(seed, closed="1"), one, 1, packet_id=pid, user_id=None)
    assert closed.seed == seed.hex() and closed.mine is None
    legacy = view_packet(_meta(None), two, 0, packet_id=pid, user_id=UserId(8))
    assert legacy.commitment is None and legacy.seed is None
    assert active.group_id == GroupId(1)


def test_the_seed_is_never_in_a_packets_repr() -> None:
    from server.money.packetrows import Packet

    seed = bytes(range(32))
    p = Packet(PacketId(1), UserId(7), GroupId(1), "lucky", 888, 2, "", None, "active", 1, 2, seed=seed)
    assert seed.hex() not in repr(p) and str(list(seed)) not in repr(p) and repr(seed) not in repr(p)
    assert p.commitment == commitment(seed) and p.shares() == [53, 835]
    assert fairness.SEED_BYTES == len(seed)


@pytest.mark.parametrize(
    ("kind", "total", "count", "said"),
    [
        ("lucky", 5, 6, "6 shares of 5 cents"),
        ("equal", 100, 0, "0 shares of 100 cents"),
        ("lucky", 10**12, 10**9, "a packet has 1 to 100000 shares"),  # (no billion draws for a hostile hub)
        ("equal", 100, 3, "cannot make an equal packet"),
        ("exclusive", 100, 2, "cannot make an exclusive packet"),
        ("huge", 100, 2, "none of lucky, equal, exclusive"),
    ],
)
def test_a_view_no_packet_can_have_is_a_mismatch_not_an_error(
    kind: str, total: int, count: int, said: str
) -> None:
    view = {**copy.deepcopy(EXAMPLE), "kind": kind, "total": total, "count": count}
    v = verify(view, EXAMPLE["commitment"])
    assert v.status == "mismatch" and any(said in p for p in v.problems), v.problems
