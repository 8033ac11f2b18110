"""The operator's commands on a running system's data: ``migrate``, ``reconcile``, ``blocks`` and
``recover``."""

from __future__ import annotations

import datetime
import re
import sys
import time

from redis.exceptions import RedisError

from server.cli.errors import OperatorError
from server.cli.services import check_services
from server.core import open_core
from server.settings import Settings
from server.store import schema
from server.store.db import Database


async def migrate(settings: Settings) -> None:
    from server.store import shards
    from server.store.engines import connect
    from server.store.mysqlkit import parse_url

    await check_services(settings, redis_too=False)
    # A migration's DDL may take long on a big table: its statements are not cut at the usual timeout.
    timeout = max(settings.db_statement_timeout_ms / 1000, 3600)
    db = await connect(settings.effective_database_url, 1, timeout)
    try:
        if settings.shard_urls:  # a Spider head over these backends (server.store.shards)
            head = parse_url(settings.effective_database_url).database
            for line in await shards.make_sharded(
                db, head, settings.shard_urls, lambda url: connect(url, 1, timeout)
            ):
                print(line)
            print(f"sharded ledger over {len(settings.shard_urls)} backends; schema version {schema.LATEST}")
            return
        applied = await schema.migrate(db)
        print(f"applied migrations: {applied or 'none (up to date)'}; schema version {schema.LATEST}")
    finally:
        await db.close()


def _when(ms: int) -> str:
    at = datetime.datetime.fromtimestamp(ms / 1000, tz=datetime.UTC)
    left = max(0, ms // 1000 - int(time.time()))
    return f"{at:%Y-%m-%d %H:%M:%S} UTC (in {left // 60} min {left % 60} s)"


async def blocks(settings: Settings, lift: int | None) -> None:
    from server.live import bots

    await check_services(settings)
    async with open_core(settings) as core:
        if lift is not None:
            print(f"user {lift}: {'unblocked' if await bots.lift(core, lift) else 'was not blocked'}")
            return
        shown = await bots.list_blocks(core)
        for b in shown:
            what = "blocked" if b.action == "block" else "throttled (one grab in 5 s)"
            print(f"user {b.user} {what} until {_when(b.until_ms)}: {b.reasons}")
        blocked = sum(1 for b in shown if b.action == "block")
        print(f"{blocked} blocked, {len(shown) - blocked} throttled")


async def reconcile(settings: Settings, as_json: bool = False) -> bool:
    """``redpacket reconcile [--json]``: the report on stdout (``--json``: as one object, which the
    worker's reconciliation reads), what it is reading on stderr; whether the books are clean."""
    from server.money.reconcile import reconcile
    from server.money.reconcilereport import render, to_json

    # Redis too: what it told grabbers is checked against the ledger.
    await check_services(settings, durability=False)
    started = time.monotonic()

    def progress(what: str) -> None:
        print(f"reconcile: {what} ({time.monotonic() - started:.1f} s)", file=sys.stderr, flush=True)

    # It reads and never migrates (a worker's child, started from the code on disk, would migrate the
    # database under processes still running the code before): a database behind the code is said.
    try:
        async with open_core(settings, migrate=False) as core:
            report = await reconcile(core, progress=progress)
    except schema.SchemaBehind as e:
        raise OperatorError(str(e), 2) from None
    print(to_json(report) if as_json else render(report))
    return report.ok


async def recover(settings: Settings, packet_ids: list[int]) -> int:
    """``redpacket recover PACKET_ID…``: each packet's Redis state rebuilt from the database. Exit 0 when
    every one was; 2 when one could not be (no such packet, or one that cannot be recovered), as
    ``verify`` says of a missing packet; 1 when Redis went away under it (run it again). Each failure
    is a line on stderr; the others go on."""
    from server.errors import RedPacketError
    from server.ids import MAX_ID, PacketId
    from server.money.packets import recover_packet

    if bad := [p for p in packet_ids if not 1 <= p <= MAX_ID]:
        raise OperatorError(f"no packet can have the id {bad[0]}", 2)
    await check_services(settings)
    code = 0
    async with open_core(settings) as core:
        for pid in packet_ids:
            try:
                r = await recover_packet(core, PacketId(pid))
            except RedPacketError as e:
                print(f"redpacket: packet {pid}: {e.message}", file=sys.stderr)
                code = max(code, 2)
                continue
            except RedisError as e:  # Redis restarted under the command: said, and the next one goes on
                print(f"redpacket: packet {pid}: Redis is unavailable ({e}); run it again", file=sys.stderr)
                code = code or 1
                continue
            print(f"packet {pid}: {r.shares_left} shares left, {r.grabs_known} grabs known")
    return code


async def verify(settings: Settings, packet_id: int, published: str | None = None) -> int:
    """``redpacket verify PACKET_ID [--commitment HEX]``: the packet's proof checked as any member can (its
    view; against ``published``, a commitment a member kept from before the seed was shown), and the
    shares the database stored against its seed. Prints what it found; 0 verified, 1 a mismatch, 3 nothing
    to check (no commitment: sent before packets were provably fair; or not revealed yet)."""
    from server.ids import MAX_ID, PacketId
    from server.money import proofs

    if not 1 <= packet_id <= MAX_ID:
        raise OperatorError(f"no packet can have the id {packet_id}", 2)
    if published is not None and not re.fullmatch(r"[0-9a-f]{64}", published):
        raise OperatorError("--commitment is 64 lowercase hex digits, as the send reply gave it", 2)
    await check_services(settings, durability=False)
    async with open_core(settings) as core:
        proof = await proofs.check(core, PacketId(packet_id), published)
    if proof is None:
        raise OperatorError(f"packet {packet_id} does not exist", 2)
    verdict, view = proof.verdict, proof.view
    print(f"packet {packet_id}: {verdict}")
    if verdict.status in ("verified", "mismatch"):
        print(f"  commitment {view['commitment']}\n  seed       {view['seed']}")
        print(f"  shares     {' '.join(map(str, verdict.shares))} (total {sum(verdict.shares)})")
    elif verdict.status == "not_revealed":
        print(
            f"  commitment {view['commitment']}; the stored shares {'do not ' if proof.wrong else ''}match it"
        )
    for line in proof.wrong:
        print(f"  {line}")
    return proof.exit_code


def since_ms(text: str) -> int:
    """An ISO 8601 time (UTC unless it says otherwise) as unix milliseconds; an operator's error if not."""
    try:
        at = datetime.datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise OperatorError(
            f"--since {text!r} is not an ISO 8601 time such as 2026-12-01T08:00Z", 2
        ) from None
    if at.tzinfo is None:
        at = at.replace(tzinfo=datetime.UTC)
    return int(at.timestamp() * 1000)


async def webhooks(settings: Settings, since: str | None, after: int | None) -> None:
    """``status`` (neither given) or ``replay`` from a time or an event id. A URL is shown by its label
    alone (``server.money.endpoints``: no ``user:password@``, no query) and its id."""
    from server.money import deliveries, events
    from server.money.endpoints import configured
    from server.money.ledger import now_ms

    hooks = configured(settings)
    if not hooks:
        raise OperatorError(
            "no webhook URLs: set REDPACKET_WEBHOOK_URLS or REDPACKET_WEBHOOK_ENDPOINTS (as the workers"
            " have them)",
            2,
        )
    if after is not None and after < 0:
        raise OperatorError("--after is an event id, 0 or more", 2)
    start = None if since is None else since_ms(since)
    await check_services(settings, redis_too=False)
    db = await _database(settings)
    try:
        if since is None and after is None:
            for e in hooks:
                q = await deliveries.state(db, e.id)
                oldest = (
                    "none" if q.oldest_pending_ms is None else f"{(now_ms() - q.oldest_pending_ms) // 1000} s"
                )
                if not q.queued:
                    print(f"{e.label} ({e.id}): no worker has run with this URL yet (nothing queued for it)")
                    continue
                print(f"{e.label} ({e.id}): {q.pending} pending (oldest {oldest}), {q.failed} failed")
            return
        first = after if after is not None else await events.seq_at(db, start or 0)
        types = {e.id: e.events for e in hooks}
        n = await deliveries.replay(db, [e.id for e in hooks], first, now_ms(), types)
        print(f"{n} deliveries of events after id {first} due again, to {len(hooks)} URL(s)")
    finally:
        await db.close()


async def _database(settings: Settings) -> Database:
    from server.store.engines import connect

    return await connect(settings.effective_database_url, 2, settings.db_statement_timeout_ms / 1000)
