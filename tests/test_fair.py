"""Provably fair packets, end to end: the commitment published before any grab, the seed kept secret
until the packet is finished or refunded (no reply, event, log or metric shows it before), the proof
verified by `redpacket verify` and by the clients, and every tamper of the shares or their order caught."""

from __future__ import annotations

import logging
import re
from typing import Any

import httpx
import pytest

from redpacket_client import fairness
from redpacket_client.fairness import commitment
from redpacket_client.reconnecting import Backoff, RedPacketClient
from server.core import Core
from server.ids import PacketId
from server.money import grabs, packets, settlement
from server.money.grabs import view_dict
from server.store import keys
from server.store.db import Tx
from server.store.records import GrabRecord
from tests.books import past_expiry
from tests.conftest import make_world
from tests.hubtools import HubUnderTest, events_of, eventually, hub_in_process, make_room

HEX64 = re.compile(r"[0-9a-f]{64}")


async def _seed(core: Core, packet_id: int) -> str:
    row = await core.db.fetchone("SELECT seed FROM red_packets WHERE id = %s", (packet_id,))
    assert row is not None and row[0] is not None
    return str(row[0])


async def _verify(
    core: Core, packet_id: int, capsys: pytest.CaptureFixture[str], kept: str | None = None
) -> tuple[int, str]:
    from server.cli.maintenance import verify

    capsys.readouterr()
    code = await verify(core.settings, packet_id, kept)
    return code, capsys.readouterr().out


async def _write(core: Core, sql: str, *args: object) -> None:
    async def work(tx: Tx) -> None:
        await tx.execute(sql, args)

    await core.db.run(work, idempotent=True)


async def _view(core: Core, p: packets.Packet, user: int) -> dict[str, Any]:
    v = await grabs.open_packet(core, packet_id=p.packet_id, group_id=p.group_id, user_id=user)  # type: ignore[arg-type]
    return view_dict(v)


async def test_the_seed_is_revealed_when_the_last_share_goes_and_the_split_verifies(
    core: Core, capsys: pytest.CaptureFixture[str]
) -> None:
    w = await make_world(core, members=4)
    p = await packets.send_packet(
        core, sender_id=w.admin, group_id=w.group, kind="lucky", total=1_000, count=4
    )
    seed = await _seed(core, p.packet_id)
    assert p.commitment == commitment(bytes.fromhex(seed)) and HEX64.fullmatch(seed)
    for user in w.members[:3]:
        await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=user)
        view = await _view(core, p, user)
        assert view["commitment"] == p.commitment and view["seed"] is None
        assert fairness.verify(view).status == "not_revealed"
    code, out = await _verify(core, p.packet_id, capsys)
    assert code == 3 and "not revealed yet" in out and "the stored shares match it" in out
    assert seed not in out
    await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=w.members[3])
    view = await _view(core, p, w.members[0])
    assert view["seed"] == seed
    verdict = fairness.verify(view)
    assert verdict.status == "verified" and sum(verdict.shares) == 1_000
    assert [g["amount"] for g in view["grabs"]] == verdict.shares  # the i-th grab got the i-th share
    code, out = await _verify(core, p.packet_id, capsys, p.commitment)
    assert code == 0 and out.startswith(f"packet {p.packet_id}: verified\n") and seed in out
    # Against a commitment other than the one published at send: the seed shown now is not the one.
    code, out = await _verify(core, p.packet_id, capsys, commitment(b"another seed"))
    assert code == 1 and "the one published at send was" in out


async def test_a_refund_reveals_the_seed_and_the_grabs_made_verify(
    core: Core, capsys: pytest.CaptureFixture[str]
) -> None:
    w = await make_world(core, members=5)
    p = await packets.send_packet(core, sender_id=w.admin, group_id=w.group, kind="lucky", total=500, count=5)
    for user in w.members[:2]:
        await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=user)
    assert (await _view(core, p, w.members[0]))["seed"] is None
    r = await settlement.refund_packet(core, p.packet_id, now=await past_expiry(core, p.packet_id))
    assert r.outcome == "refunded"
    view = await _view(core, p, w.members[0])  # from the database now
    assert view["seed"] == await _seed(core, p.packet_id) and len(view["grabs"]) == 2
    verdict = fairness.verify(view)
    assert verdict.status == "verified" and r.amount == sum(verdict.shares[2:])
    assert (await _verify(core, p.packet_id, capsys))[0] == 0


async def test_equal_and_exclusive_packets_carry_a_proof_too(core: Core) -> None:
    w = await make_world(core, members=3)
    for kind, total, count, target in (("equal", 300, 3, None), ("exclusive", 77, 1, w.members[1])):
        p = await packets.send_packet(
            core,
            sender_id=w.admin,
            group_id=w.group,
            kind=kind,
            total=total,
            count=count,
            target_user_id=target,
        )
        for user in w.members[:count] if target is None else [target]:
            await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=user)
        assert fairness.verify(await _view(core, p, w.members[1])).status == "verified"


async def _finished(core: Core, total: int = 1_000, count: int = 3) -> packets.Packet:
    w = await make_world(core, members=count)
    p = await packets.send_packet(
        core, sender_id=w.admin, group_id=w.group, kind="lucky", total=total, count=count
    )
    for user in w.members:
        await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=user)
    return p


async def _rewrite_grabs(core: Core, p: packets.Packet, change: dict[int, tuple[int, int]]) -> None:
    """Give the grabs of the shares named (seq → (seq, amount)) other records in Redis, as a rigged
    server would hand them out. Every grab's time is made its own millisecond, in the order they were
    made (grabs of one millisecond are listed by seq)."""
    key = keys.packet_grabs(group_id=p.group_id, packet_id=p.packet_id)
    for n, (user, raw) in enumerate(sorted((await core.redis.hgetall(key)).items(), key=lambda x: x[1])):
        r = GrabRecord.parse(raw)
        seq, amount = change.get(r.seq, (r.seq, r.amount))
        await core.redis.hset(key, user, f"{seq}:{amount}:{r.grabbed_ms + n}")


async def test_verify_catches_a_share_handed_to_another_place(
    core: Core, capsys: pytest.CaptureFixture[str]
) -> None:
    p = await _finished(core)  # 1,000 cents in 3 shares: never all alike
    shares = p.shares()
    k = next(k for k in (2, 3) if shares[k - 1] != shares[0])
    # Share k's grabber gets the first share's amount and the first share's grabber share k's: the sums
    # still add up.
    await _rewrite_grabs(core, p, {1: (1, shares[k - 1]), k: (k, shares[0])})
    verdict = fairness.verify(await _view(core, p, p.sender_id))
    assert verdict.status == "mismatch" and len(verdict.problems) == 2, verdict.problems
    code, out = await _verify(core, p.packet_id, capsys)
    assert code == 1 and f"got {shares[k - 1]} cents; share 1 is {shares[0]}" in out
    # Handed out out of order: the first grab given share 3 (with its amount), the last share 1.
    await _rewrite_grabs(core, p, {1: (3, shares[2]), 3: (1, shares[0])})
    verdict = fairness.verify(await _view(core, p, p.sender_id))
    assert verdict.status == "mismatch"
    assert any("got share 1 after share 3: not handed out in the order drawn" in x for x in verdict.problems)


async def test_verify_catches_shares_the_database_holds_other_than_drawn(
    core: Core, capsys: pytest.CaptureFixture[str]
) -> None:
    w = await make_world(core, members=3)
    p = await packets.send_packet(core, sender_id=w.admin, group_id=w.group, kind="lucky", total=900, count=3)
    drawn = p.shares()
    await _write(
        core,
        "UPDATE red_packet_shares SET amount = %s WHERE packet_id = %s AND seq = 1",
        drawn[0] + 1,
        p.packet_id,
    )
    code, out = await _verify(core, p.packet_id, capsys)
    # Active: which share differs, not the amounts (they are the shares still to come).
    assert code == 1 and "stored share 1 differs from the one drawn" in out and "do not match" in out
    assert "cents" not in out
    for user in w.members:
        await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=user)
    code, out = await _verify(core, p.packet_id, capsys)
    assert code == 1 and f"stored share 1 is {drawn[0] + 1} cents; drawn {drawn[0]}" in out


async def test_a_packet_sent_before_packets_were_fair_is_not_verifiable_never_failed(
    core: Core, capsys: pytest.CaptureFixture[str]
) -> None:
    p = await _finished(core)
    await _write(core, "UPDATE red_packets SET seed = NULL WHERE id = %s", p.packet_id)
    await core.redis.hdel(keys.packet_meta(group_id=p.group_id, packet_id=p.packet_id), "seed")
    view = await _view(core, p, p.sender_id)
    assert view["commitment"] is None and view["seed"] is None
    assert fairness.verify(view).status == "not_verifiable"
    code, out = await _verify(core, p.packet_id, capsys)
    assert code == 3 and "not verifiable" in out and "mismatch" not in out


async def test_verify_of_no_packet_is_an_operators_error(core: Core) -> None:
    from server.cli.errors import OperatorError
    from server.cli.maintenance import verify

    for pid in (0, 10**12):
        with pytest.raises(OperatorError):
            await verify(core.settings, pid)


def _all_text(records: list[logging.LogRecord]) -> str:
    return "\n".join(f"{r.getMessage()} {r.args!r} {r.exc_text or ''}" for r in records)


async def test_over_the_socket_the_commitment_comes_first_and_the_seed_only_at_the_end(
    hub_settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    async with hub_in_process(hub_settings) as h:
        await _socket_story(h, caplog)


async def _socket_story(h: HubUnderTest, caplog: pytest.LogCaptureFixture) -> None:
    room = await make_room(h, 3)
    admin = await h.client(room.admin_token, "json")
    members = [await h.client(token) for _, token in room.members]
    # A client that keeps the commitments it hears of (the packet event, before any grab).
    keeper = await RedPacketClient.connect(h.ws, room.members[2][1], backoff=Backoff(0.05, 0.2))
    await keeper.sync()
    sent = await admin.request("send", group=room.group, kind="lucky", total=1_000, count=3)
    pid = PacketId(sent["packet_id"])
    seed = await _seed(h.core, pid)
    assert sent["commitment"] == commitment(bytes.fromhex(seed)) and "seed" not in sent
    seen: list[object] = [sent]
    event = (await events_of(members[0], 1, "packet"))[0]
    assert event["data"]["commitment"] == sent["commitment"] and "seed" not in event["data"]  # type: ignore[index]
    seen.append(event)
    for c in members[:2]:
        seen.append(await c.request("grab", group=room.group, packet=pid))
        seen.append(await c.request("open", group=room.group, packet=pid))
    seen.append(await h.api("GET", f"/api/packets/{pid}", room.admin_token))
    seen.append(await h.api("GET", "/api/me/packets/sent", room.admin_token))
    seen.append(await members[0].request("sync", groups={str(room.group): None}))
    async with httpx.AsyncClient(base_url=h.http, timeout=30) as http:
        seen.append((await http.get("/metrics")).text)
    # While the packet is active the seed is in no reply, event, metric or log line.
    assert seed not in repr(seen) and seed not in _all_text(caplog.records)
    assert all(v["seed"] is None for v in seen[3:6:2])  # type: ignore[index]
    await members[2].request("grab", group=room.group, packet=pid)
    finished = (await events_of(members[0], 1, "finished"))[0]["data"]
    assert finished["seed"] == seed and finished["commitment"] == sent["commitment"]  # type: ignore[index]
    view = await members[1].request("open", group=room.group, packet=pid)
    assert fairness.verify(view).status == "verified"
    detail = await h.api("GET", f"/api/packets/{pid}", room.admin_token)
    assert detail["seed"] == seed and fairness.verify(detail).status == "verified"
    await eventually(lambda: keeper.commitment(pid) == sent["commitment"])  # heard from the packet event
    kept = await keeper.verify(room.group, pid)
    assert kept.status == "verified" and kept.against_send
    # The server shows another seed now (one chosen after the grabs, with its own commitment): caught.
    meta = keys.packet_meta(group_id=room.group, packet_id=pid)  # type: ignore[arg-type]
    await h.core.redis.hset(meta, "seed", "ab" * 32)
    rigged = await keeper.verify(room.group, pid)
    assert rigged.status == "mismatch" and "the one published at send was" in rigged.problems[0]
    await keeper.close()
    for c in [admin, *members]:
        await c.close()
