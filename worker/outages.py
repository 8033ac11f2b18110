"""What the worker says while Redis or the database is away: one line when a service goes away (the first
failure any of the worker's loops meets), one when it is back (the heartbeat reached it again), with how
long it was away and how many attempts failed meanwhile, by loop. Nothing in between: a loop that
happened to touch only the other service says nothing of this one.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

from server import errors
from server.core import transient, unavailable
from server.store.batch import NotDurable
from server.store.redisnodes import Evicting

log = logging.getLogger("worker")

Service = Literal["Redis", "the database"]
REDIS: Service = "Redis"
DATABASE: Service = "the database"


def service_of(e: BaseException) -> Service | None:
    """The service whose being away ``e`` shows (``server.core.transient``), or None: a bug, a refusal that
    is an answer, or Redis answering but not as asked (a grab's durability short, a master evicting) —
    what its loop says itself, as Redis is there for the heartbeat to reach."""
    if not transient(e) or isinstance(e, Evicting | NotDurable):
        return None
    down = unavailable(e)
    return REDIS if down is not None and down.code == errors.REDIS_UNAVAILABLE else DATABASE


@dataclass
class _Away:
    since: float
    reason: str
    failures: Counter[str] = field(default_factory=Counter)  # by loop


@dataclass
class Outages:
    """The services away now, as this worker's loops met them."""

    away: dict[Service, _Away] = field(default_factory=dict)

    def failed(self, loop: str, e: BaseException) -> bool:
        """``loop`` failed with ``e``: True if that is a service away (said once, counted after), False
        if it is not (the loop says what it is)."""
        service = service_of(e)
        if service is None:
            return False
        away = self.away.get(service)
        if away is None:
            away = self.away[service] = _Away(time.monotonic(), str(e) or type(e).__name__)
            log.warning(
                "%s is unavailable (%s, met by the %s): retrying until it is back", service, away.reason, loop
            )
        away.failures[loop] += 1
        return True

    def reached(self, service: Service) -> None:
        """The heartbeat reached ``service``: if it was away, say it is back."""
        away = self.away.pop(service, None)
        if away is None:
            return
        tries = ", ".join(f"{loop} {n}" for loop, n in away.failures.most_common())
        log.warning(
            "%s is back after %.0f s (attempts that failed meanwhile: %s)",
            service,
            time.monotonic() - away.since,
            tries,
        )
