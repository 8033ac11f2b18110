"""The operator's commands on a running system's data: ``migrate``, ``reconcile``, ``blocks`` and
``recover``."""

from __future__ import annotations

import datetime
import time

from redis.exceptions import RedisError

from server.cli.errors import OperatorError
from server.cli.services import check_services
from server.core import open_core
from server.settings import Settings


async def migrate(settings: Settings) -> None:
    from server.store import schema
    from server.store.engines import connect

    await check_services(settings, redis_too=False)
    # A migration's DDL may take long on a big table: its statements are not cut at the usual timeout.
    db = await connect(settings.effective_database_url, 1, max(settings.db_statement_timeout_ms / 1000, 3600))
    try:
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


async def reconcile(settings: Settings) -> bool:
    from server.money.reconcile import reconcile, render

    # Redis too: what it told grabbers is checked against the ledger.
    await check_services(settings, durability=False)
    async with open_core(settings) as core:
        report = await reconcile(core)
    print(render(report))
    return report.ok


async def recover(settings: Settings, packet_ids: list[int]) -> None:
    from server.errors import RedPacketError
    from server.ids import MAX_ID, PacketId
    from server.money.packets import recover_packet

    if bad := [p for p in packet_ids if not 1 <= p <= MAX_ID]:
        raise OperatorError(f"no packet can have the id {bad[0]}", 2)
    await check_services(settings)
    async with open_core(settings) as core:
        for pid in packet_ids:
            try:
                r = await recover_packet(core, PacketId(pid))
            except RedPacketError as e:
                print(f"packet {pid}: {e.message}")
                continue
            except RedisError as e:  # Redis restarted under the command: said, and the next one goes on
                print(f"packet {pid}: Redis is unavailable ({e}); run it again")
                continue
            print(f"packet {pid}: {r.shares_left} shares left, {r.grabs_known} grabs known")
