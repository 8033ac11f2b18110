"""The service API's look at the webhooks (``/api/service/webhooks…``, behind the service key as every
``/api/service`` route: ``server.hub.service.routes``): the endpoints this hub's settings name — the
workers' (``server.money.endpoints``) — and each one's deliveries, status, tries, last error and next try.

Never a secret: an endpoint is shown by its id (a hash of its URL) and its URL's ``label``, and a
delivery's last error was scrubbed of the URL's secrets before it was stored (``worker.webhooks``).
Every list is paged by the one convention (``server.hub.httpkit.page``). A list of deliveries first
queues what the workers have not queued yet (as the events API sequences first), so it is whole
whether or not a worker has caught up.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from server import errors
from server.core import Core
from server.errors import InvalidRequest, NotFound
from server.hub.httpkit import page, page_ask
from server.ids import MAX_ID, UserId
from server.money import deliveries, events
from server.money.endpoints import Endpoint, configured, scrub
from server.money.ledger import now_ms

ENDPOINTS_PAGE = 100
DELIVERIES_PAGE = 100
MAX_DELIVERIES_PAGE = 500
CATCH_UP = 10  # batches of ``deliveries.QUEUE_BATCH`` events


def _endpoint(request: Request, core: Core) -> Endpoint:
    wanted = request.path_params["endpoint"]
    for e in configured(core.settings):
        if e.id == wanted:
            return e
    raise NotFound(
        errors.WEBHOOK_NOT_FOUND,
        "no webhook endpoint of that id on this hub: GET /api/service/webhooks lists them",
    )


async def _caught_up(core: Core, e: Endpoint) -> None:
    """What a worker would have queued for ``e`` by now, queued (the workers' own idempotent call), up to
    ``CATCH_UP`` batches: an endpoint new to a long history is queued the rest by its workers."""
    await events.sequence(core.db)
    cursor = -1
    for _ in range(CATCH_UP):
        if (at := await deliveries.last_queued(core.db, e.id)) == cursor:
            return
        cursor = at
        await deliveries.queue(core.db, e.id, now_ms(), e.events)


async def endpoint_page(request: Request, core: Core, _: UserId) -> dict[str, object]:
    """The webhook endpoints, in the order the settings give them (``position``, 1 up: the cursor), each
    with its event types (null: every type) and how many deliveries are pending and failed."""
    ask = page_ask(request, default=ENDPOINTS_PAGE, most=ENDPOINTS_PAGE)
    hooks = configured(core.settings)
    found: list[dict[str, object]] = []
    for position, e in enumerate(hooks[ask.after : ask.after + ask.limit + 1], start=ask.after + 1):
        q = await deliveries.state(core.db, e.id)
        found.append({"position": position, **e.view(), "pending": q.pending, "failed": q.failed})
    return page("webhooks", found, ask, cursor="position", newest=len(hooks))


async def delivery_page(request: Request, core: Core, _: UserId) -> dict[str, object]:
    """An endpoint's deliveries by event id, oldest first; ``?status=pending|delivered|failed`` for one
    status only."""
    e = _endpoint(request, core)
    status = request.query_params.get("status")
    if status is not None and status not in deliveries.STATUSES:
        raise InvalidRequest(errors.BAD_REQUEST, f"status is one of {', '.join(deliveries.STATUSES)}")
    ask = page_ask(request, default=DELIVERIES_PAGE, most=MAX_DELIVERIES_PAGE)
    await _caught_up(core, e)
    found = await deliveries.listing(
        core.db,
        e.id,
        after=ask.after,
        limit=ask.limit + 1,
        status=next((s for s in deliveries.STATUSES if s == status), None),
    )
    newest = None if found else await deliveries.last_queued(core.db, e.id)
    shown = [_shown(d, e) for d in found]
    return {"webhook": e.id, **page("deliveries", shown, ask, cursor="event_id", newest=newest)}


def _shown(d: dict[str, Any], e: Endpoint) -> dict[str, Any]:
    """A delivery as the API shows it: its error without the URL's secrets, even one stored before errors
    were scrubbed as they are written."""
    error = d.get("last_error")
    return d if error is None else {**d, "last_error": scrub(str(error), e.url)}


async def delivery(request: Request, core: Core, _: UserId) -> dict[str, object]:
    """One event's delivery to an endpoint."""
    e = _endpoint(request, core)
    given = str(request.path_params["event_id"])
    if not (given.isascii() and given.isdigit() and len(given) <= 19 and int(given) <= MAX_ID):
        raise InvalidRequest(errors.BAD_REQUEST, "an event id is a whole number, 0 to 2^63-1")
    seq = int(given)
    await _caught_up(core, e)
    found = await deliveries.one(core.db, e.id, seq)
    if found is None:
        raise NotFound(
            errors.WEBHOOK_NOT_FOUND,
            f"no delivery of event {seq} to this endpoint: no such event yet, or not of a type it takes",
        )
    return {"webhook": e.id, **_shown(found, e)}
