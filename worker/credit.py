"""The credit job: pay one grab into the grabber's balance.

Idempotent on the grab's unique keys: arq delivers at least once (a worker killed mid-job has the job
run again), and a second run credits nothing.
"""

from __future__ import annotations

import logging
from typing import TypedDict

from arq import Retry

from server.core import Core
from server.db import RetryableError
from server.errors import Conflict, NotFound
from server.ledger import Credit, credit_grab

log = logging.getLogger(__name__)


class Ctx(TypedDict, total=False):
    """What arq passes every job: our Core under "core", plus arq's own fields."""

    core: Core
    job_try: int


async def credit_grab_job(
    ctx: Ctx, packet_id: int, user_id: int, seq: int, amount: int, grabbed_ms: int
) -> str:
    """Credit one grab. Cancelled half-way: the transaction rolls back and arq runs the job again."""
    core = ctx["core"]
    try:
        return await credit_grab(core.db, Credit(packet_id, user_id, seq, amount, grabbed_ms))
    except RetryableError as e:
        log.warning("credit of packet %d share %d will be retried: %s", packet_id, seq, e)
        raise Retry(defer=ctx.get("job_try", 1) * 0.5) from e
    except (Conflict, NotFound) as e:
        # Retrying cannot fix these; the reconciliation report shows them. Never pay on a guess.
        log.error("credit of packet %d share %d refused: %s %s", packet_id, seq, e.code, e.message)
        return e.code
