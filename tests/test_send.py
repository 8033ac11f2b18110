"""Send: one transaction debits, writes the packet, its shares and the journal row — or nothing."""

from __future__ import annotations

import asyncio

import pytest
import redis

from server import errors
from server.core import Core
from server.errors import RedPacketError
from server.money import grabs, groups, journal, ledger, packets
from server.store import keys
from server.store.db import IntegrityError, Tx
from tests.conftest import make_world


async def _snapshot(core: Core) -> tuple[list[tuple[object, ...]], list[tuple[object, ...]], int, int]:
    balances = await core.db.fetchall("SELECT user_id, balance FROM accounts ORDER BY user_id")
    journal = await core.db.fetchall("SELECT account_id, amount, idem_key FROM journal ORDER BY id")
    packets_row = await core.db.fetchone("SELECT COUNT(*) FROM red_packets")
    shares_row = await core.db.fetchone("SELECT COUNT(*) FROM red_packet_shares")
    assert packets_row is not None and shares_row is not None
    return balances, journal, int(packets_row[0]), int(shares_row[0])


async def test_send_debits_and_writes_shares_that_add_up(core: Core) -> None:
    w = await make_world(core, members=3, admin_cents=10_000)
    p = await packets.send_packet(
        core, sender_id=w.admin, group_id=w.group, kind="lucky", total=1_000, count=3, greeting="恭喜发财"
    )
    assert p.published and not p.replay
    assert await ledger.balance(core.db, w.admin) == 9_000
    assert await journal.journal_sum(core.db, w.admin) == 9_000
    rows = await core.db.fetchall(
        "SELECT seq, amount FROM red_packet_shares WHERE packet_id = %s", (p.packet_id,)
    )
    assert sorted(int(r[0]) for r in rows) == [1, 2, 3]
    assert sum(int(r[1]) for r in rows) == 1_000
    # The same shares, in seq order, wait in Redis.
    in_redis = await core.redis.lrange(keys.packet_shares(group_id=w.group, packet_id=p.packet_id), 0, -1)
    assert [x.decode() for x in in_redis] == [f"{int(r[0])}:{int(r[1])}" for r in sorted(rows)]


async def test_request_id_makes_a_retried_send_pay_once(core: Core) -> None:
    w = await make_world(core, admin_cents=10_000)
    a = await packets.send_packet(
        core, sender_id=w.admin, group_id=w.group, kind="equal", total=600, count=3, request_id="tap-1"
    )
    b = await packets.send_packet(
        core, sender_id=w.admin, group_id=w.group, kind="equal", total=600, count=3, request_id="tap-1"
    )
    assert b.replay and b.packet_id == a.packet_id
    assert await ledger.balance(core.db, w.admin) == 9_400
    with pytest.raises(RedPacketError) as e:
        await packets.send_packet(
            core, sender_id=w.admin, group_id=w.group, kind="equal", total=900, count=3, request_id="tap-1"
        )
    assert e.value.code == errors.IDEMPOTENCY_KEY_REUSED
    assert await ledger.balance(core.db, w.admin) == 9_400


BAD_SENDS = [
    ({"total": 0}, errors.AMOUNT_INVALID),
    ({"total": -100}, errors.AMOUNT_INVALID),
    ({"total": 99.5}, errors.AMOUNT_INVALID),
    ({"total": 10**18}, errors.AMOUNT_TOO_LARGE),
    ({"count": 0}, errors.COUNT_INVALID),
    ({"count": 101}, errors.COUNT_TOO_LARGE),
    ({"count": 4}, errors.COUNT_TOO_LARGE),  # more shares than the group's 3 members
    ({"total": 5, "count": 6}, errors.COUNT_EXCEEDS_AMOUNT),
    ({"kind": "equal", "total": 100, "count": 3}, errors.EQUAL_NOT_DIVISIBLE),
    ({"kind": "bogus"}, errors.KIND_INVALID),
    ({"total": 20_000, "count": 1, "rich": False}, errors.INSUFFICIENT_FUNDS),
    ({"sender": "outsider"}, errors.NOT_MEMBER),
    ({"sender": "member"}, errors.NOT_ADMIN),
    ({"group": 999_999}, errors.GROUP_NOT_FOUND),
    ({"kind": "exclusive", "count": 1, "target": "outsider"}, errors.TARGET_INVALID),
    ({"kind": "exclusive", "count": 1, "target": "admin"}, errors.TARGET_INVALID),
]


@pytest.mark.parametrize(("change", "code"), BAD_SENDS, ids=[c for _, c in BAD_SENDS])
async def test_bad_sends_have_a_code_and_move_no_money(
    core: Core, change: dict[str, object], code: str
) -> None:
    w = await make_world(core, members=2, admin_cents=10_000 if change.get("rich", True) else 19_999)
    outsider = await ledger.create_user(core.db, "outsider")
    await ledger.topup(core.db, outsider, 50_000, "seed")
    who = {"admin": w.admin, "member": w.members[0], "outsider": outsider}
    await ledger.topup(core.db, w.members[0], 50_000, "seed")
    before = await _snapshot(core)
    target = change.get("target")
    with pytest.raises(RedPacketError) as e:
        await packets.send_packet(
            core,
            sender_id=who[str(change.get("sender", "admin"))],
            group_id=int(change.get("group", w.group)),  # type: ignore[call-overload]
            kind=change.get("kind", "lucky"),
            total=change.get("total", 1_000),
            count=change.get("count", 3),
            greeting="",
            target_user_id=who[str(target)] if target else None,
        )
    assert e.value.code == code
    assert await _snapshot(core) == before


async def test_members_may_send_where_the_group_allows_it(core: Core) -> None:
    w = await make_world(core, members=1)
    open_group = await groups.create_group(core.db, w.admin, "open", members_can_send=True)
    await groups.add_members(core.db, core.membership, open_group, w.members)
    await ledger.topup(core.db, w.members[0], 1_000, "seed")
    p = await packets.send_packet(
        core, sender_id=w.members[0], group_id=open_group, kind="lucky", total=1_000, count=2
    )
    assert await ledger.balance(core.db, w.members[0]) == 0
    assert p.total == 1_000


async def test_redis_failing_after_the_commit_keeps_the_packet_and_recover_publishes_it(
    core: Core, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = await make_world(core, members=2, admin_cents=10_000)

    async def redis_gone(**_: object) -> None:
        raise redis.ConnectionError("Redis went away between the commit and the load")

    with monkeypatch.context() as m:
        m.setattr(core.scripts, "load_packet", redis_gone)
        p = await packets.send_packet(
            core, sender_id=w.admin, group_id=w.group, kind="lucky", total=800, count=2
        )
    assert not p.published
    assert await ledger.balance(core.db, w.admin) == 9_200
    assert await core.redis.exists(keys.packet_meta(group_id=w.group, packet_id=p.packet_id)) == 0
    r = await packets.recover_packet(core, p.packet_id)
    assert (r.shares_left, r.grabs_known) == (2, 0)
    got = await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=w.members[0])
    assert got.outcome == "won"


async def test_ten_concurrent_sends_with_one_request_id_pay_once(
    core: Core, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client's retries racing each other: one packet, one debit; the others answer it as a replay.
    On MariaDB all ten are made to look for an earlier send before any inserts (the look is held until
    all have made it), so nine meet the unique key of the one that won and answer from there; SQLite
    has one writer, so there each finds the earlier send."""
    w = await make_world(core, members=3, admin_cents=10_000)
    looked, clashes = asyncio.Event(), []
    lookers: list[int] = []
    real_fetchone, real_execute, real_executemany = Tx.fetchone, Tx.execute, Tx.executemany

    async def fetchone(tx: Tx, statement: str, params: object = ()) -> tuple[object, ...] | None:
        row = await real_fetchone(tx, statement, params)  # type: ignore[arg-type]
        # (The look for an earlier send: on a sharded ledger, for its debit on the sender's shard.)
        if statement.startswith(
            ("SELECT 1 FROM red_packets WHERE sender_id", "SELECT id, amount, tx FROM journal")
        ):
            lookers.append(1)
            if len(lookers) == 10:
                looked.set()
            await looked.wait()
        return row

    async def execute(tx: Tx, statement: str, params: object = ()) -> int:
        try:
            return await real_execute(tx, statement, params)  # type: ignore[arg-type]
        except IntegrityError:
            clashes.append(statement.split("(")[0])
            raise

    async def executemany(tx: Tx, statement: str, params: object) -> None:  # (the journal's one INSERT)
        try:
            await real_executemany(tx, statement, params)  # type: ignore[arg-type]
        except IntegrityError:
            clashes.append(statement.split("(")[0])
            raise

    if core.db.dialect.name == "mysql":
        monkeypatch.setattr(Tx, "fetchone", fetchone)
        monkeypatch.setattr(Tx, "execute", execute)
        monkeypatch.setattr(Tx, "executemany", executemany)
    sent = await asyncio.gather(
        *(
            packets.send_packet(
                core,
                sender_id=w.admin,
                group_id=w.group,
                kind="lucky",
                total=600,
                count=3,
                request_id="double-tap",
            )
            for _ in range(10)
        )
    )
    monkeypatch.undo()
    if core.db.dialect.name == "mysql" and not core.db.shards:  # the unique key decided nine of them
        assert clashes == ["INSERT INTO red_packets "] * 9
    elif core.db.shards:  # the debit's key, on the sender's shard (then the packet's id may clash too)
        assert [c for c in clashes if "journal" in c] == ["INSERT INTO journal "] * 9
    assert len({p.packet_id for p in sent}) == 1
    assert sorted(p.replay for p in sent) == [False] + [True] * 9
    assert await ledger.balance(core.db, w.admin) == 9_400
    row = await core.db.fetchone("SELECT COUNT(*) FROM journal WHERE kind = 'send'")
    assert row is not None and int(row[0]) == 1
    # Another packet under the same id is a mistake, said as such; nothing moves.
    with pytest.raises(RedPacketError) as e:
        await packets.send_packet(
            core,
            sender_id=w.admin,
            group_id=w.group,
            kind="lucky",
            total=601,
            count=3,
            request_id="double-tap",
        )
    assert e.value.code == errors.IDEMPOTENCY_KEY_REUSED
    assert await ledger.balance(core.db, w.admin) == 9_400


async def test_a_send_whose_shares_insert_fails_writes_nothing_and_is_no_replay(
    core: Core, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the packet row's own key makes a send a replay. A failure of its shares' insert (a key or a
    check refusing a row) was once taken for one: the row this very transaction had just written was
    found, answered ``replay: true`` and committed — a packet with no debit and no shares, whose refund
    then paid its total to the sender out of nothing. Now the send fails and writes nothing (on a sharded
    ledger the debit, on its own shard first, waits for ``void_unsent`` as any unmade send's)."""
    w = await make_world(core, members=3, admin_cents=10_000)
    real_executemany = Tx.executemany
    refused: list[str] = []

    async def executemany(tx: Tx, statement: str, rows: object) -> int:
        if statement.startswith("INSERT INTO red_packet_shares"):
            refused.append(statement)
            raise IntegrityError("a share refused (as a CHECK or a key would)")
        return await real_executemany(tx, statement, rows)  # type: ignore[arg-type]

    monkeypatch.setattr(Tx, "executemany", executemany)
    with pytest.raises(IntegrityError):
        await packets.send_packet(
            core, sender_id=w.admin, group_id=w.group, kind="lucky", total=900, count=3, request_id="s-1"
        )
    assert refused  # the dangerous state: the packet's row written, its shares refused
    monkeypatch.undo()
    row = await core.db.fetchone("SELECT COUNT(*) FROM red_packets WHERE sender_id = %s", (w.admin,))
    assert row is not None and int(row[0]) == 0
    if not core.db.shards:
        assert await ledger.balance(core.db, w.admin) == 10_000
