"""The webhook dispatcher: every event of the outbox POSTed to each webhook endpoint that takes its type
(``server.money.endpoints``: ``REDPACKET_WEBHOOK_URLS`` and ``REDPACKET_WEBHOOK_ENDPOINTS``), signed.

Runs in every worker; the database's queue (``server.money.deliveries``) hands each delivery to one of
them at a time, in order per user. A round: number the new events (``events.sequence``), queue them for
each URL, claim the due deliveries, POST them concurrently, and mark each delivered (a 2xx answer) or due
again after an exponential back-off with jitter (``REDPACKET_WEBHOOK_RETRY_MS`` doubling to an hour),
until ``REDPACKET_WEBHOOK_GIVE_UP_HOURS`` after its event: then ``failed`` (counted, on the dashboard;
``redpacket webhooks replay`` sends it again). Delivery is at least once; a receiver dedupes by event id.

A request: ``POST`` of the event (``{"id", "type", "created_ms", "user_id", "data"}``, JSON) with
``Redpacket-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256 of "<t>." + body, keyed by
the endpoint's secret>`` (docs/integration.md shows how a receiver checks it, and refuses a ``t`` more
than 5 minutes from its clock), ``Redpacket-Event-Id`` and ``Redpacket-Event-Type``.

**A receiver cannot take the worker down** (the worker pays credits too): of its answer only the status
is used. The request asks for ``identity``; the answer is streamed, and at most ``ANSWER_BYTES`` of its
raw bytes are read (never decompressed: a gzip bomb stays 200 KB on the wire), all within the request's
one timeout, so a receiver that trickles its answer is cut off with the rest. Memory per request in
flight is bounded by one socket read, whatever the receiver sends. A URL's secrets (its
``user:password@``, its query) are never logged nor stored: it is named by its ``label``, and an error's
text is scrubbed of them (``server.money.endpoints``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections.abc import AsyncGenerator
from typing import cast

import httpx

from server import tracing
from server.core import Core
from server.money import deliveries, events
from server.money.endpoints import Endpoint, configured, label, scrub
from server.money.ledger import now_ms
from server.signing import SIGNATURE_HEADER, sign
from server.stopping import check_cancelled
from server.store import keys
from worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)

# Deliveries claimed per URL per round (sent concurrently), and the pause when there was nothing to do.
PER_ROUND = 50
IDLE_S = 0.2
MAX_RETRY_MS = 3_600_000
# How often the queue's gauges are read.
OBSERVE_S = 2.0
# A failing URL is said in the log at most this often.
WARN_EVERY_S = 60.0
# The most of an answer's body read (raw, as it came): enough for a short answer to end, so its
# connection is kept for the next request; a longer one is cut (its connection closed).
ANSWER_BYTES = 4096


def retry_after_ms(attempts: int, base_ms: int, rng: random.Random) -> int:
    """The wait before try ``attempts + 1``: ``base_ms`` doubling per try to an hour, half of it random
    (so deliveries that failed together do not all come back together)."""
    ceiling = int(min(MAX_RETRY_MS, base_ms * 2 ** min(max(attempts - 1, 0), 32)))
    return ceiling // 2 + rng.randrange(ceiling // 2 + 1)


def encode(event: events.Event) -> bytes:
    return json.dumps(event, separators=(",", ":"), ensure_ascii=False).encode()


class Dispatcher:
    def __init__(
        self, core: Core, metrics: WorkerMetrics | None = None, client: httpx.AsyncClient | None = None
    ) -> None:
        self.core = core
        self.settings = core.settings
        self.metrics = metrics or WorkerMetrics()
        self.endpoints = {e.id: e for e in configured(self.settings)}
        for e in self.endpoints.values():
            self.metrics.webhooks.known(e.label)
        self.client = client
        self.rng = random.Random()
        # How long a claimed delivery is this dispatcher's: past it, another may send it again. Twice the
        # answer's timeout and a second: a request still in flight has been given up by then.
        self.lease_ms = 2 * self.settings.webhook_timeout_ms + 1000
        self.observed: dict[str, float] = {}  # endpoint → when its gauges were last read
        self.warned: dict[str, float] = {}  # endpoint → when its last failure was logged

    async def run(self) -> None:
        """Deliver until cancelled: each URL in a loop of its own (a receiver that answers slowly delays
        only its own deliveries), each riding out database outages with back-off."""
        timeout = httpx.Timeout(self.settings.webhook_timeout_ms / 1000)
        limits = httpx.Limits(max_connections=PER_ROUND * max(len(self.endpoints), 1))
        async with httpx.AsyncClient(timeout=timeout, limits=limits, follow_redirects=False) as client:
            self.client = self.client or client
            await asyncio.gather(*(self.deliver_to(endpoint) for endpoint in self.endpoints))

    async def deliver_to(self, endpoint: str) -> None:
        failures = 0
        while True:
            check_cancelled()
            try:
                await events.sequence(self.core.db)  # (one at a time holds the counter: cheap when none)
                busy = await self.deliver_round(endpoint, self.endpoints[endpoint])
                failures = 0
            except Exception as e:
                if not self.metrics.outages.failed("webhook dispatcher", e):
                    log.exception("webhook round failed")
                failures += 1
                busy = False
                await asyncio.sleep(min(0.1 * 2**failures, 5.0))
            if not busy:
                await asyncio.sleep(IDLE_S)

    async def round(self) -> bool:
        """One round over every URL; True if anything was sent (another round at once)."""
        await events.sequence(self.core.db)
        sent = [await self.deliver_round(endpoint, e) for endpoint, e in self.endpoints.items()]
        return any(sent)

    async def deliver_round(self, endpoint: str, e: Endpoint) -> bool:
        """One round of one URL: queue its new events, send what is due; True if anything was sent."""
        db = self.core.db
        now = now_ms()
        await deliveries.queue(db, endpoint, now, e.events)
        token, claimed = await deliveries.claim(db, endpoint, now, self.lease_ms, PER_ROUND)
        if claimed:
            await asyncio.gather(*(self.deliver(e, token, c) for c in claimed))
        if time.monotonic() - self.observed.get(endpoint, 0.0) >= OBSERVE_S:
            await self.observe(endpoint, e.url)
        return bool(claimed)

    async def status_of(self, url: str, body: bytes, headers: dict[str, str]) -> int:
        """POST ``body`` and return the answer's status, having read at most ``ANSWER_BYTES`` of the answer
        raw (never decoded). Cancelling it closes the answer and its connection."""
        assert self.client is not None
        request = self.client.build_request("POST", url, content=body, headers=headers)
        answer = await self.client.send(request, stream=True)
        try:
            read = 0
            # (aiter_raw is an async generator, typed as an iterator: closed here, not left to the GC.)
            raw = cast(AsyncGenerator[bytes, None], answer.aiter_raw())
            async with contextlib.aclosing(raw) as chunks:
                async for chunk in chunks:
                    read += len(chunk)
                    if read >= ANSWER_BYTES:
                        break
        finally:
            await answer.aclose()
        return answer.status_code

    async def deliver(self, e: Endpoint, token: int, c: deliveries.Claimed) -> None:
        """One try of one delivery; tracing, in a span that joins the trace of the money move the event
        reports (``server.tracing``), its context sent on as the request's ``traceparent``."""
        parent = await _kept_for(self.core, c.event) if tracing.ON else ""
        if not parent and not (tracing.ON and tracing.draw()):  # (kept: its move was drawn)
            await self._deliver(e, token, c, {})
            return
        attributes = {
            "event_id": c.seq,
            "event_type": c.event["type"],
            "endpoint": e.label,
            "attempt": c.attempts,
        }
        with tracing.span("webhook delivery", "client", parent=parent or None, **attributes):
            await self._deliver(e, token, c, {"traceparent": tracing.traceparent()})

    async def _deliver(self, e: Endpoint, token: int, c: deliveries.Claimed, extra: dict[str, str]) -> None:
        endpoint, body = e.id, encode(c.event)
        headers = {
            **extra,
            "Content-Type": "application/json",
            "User-Agent": "redpacket-webhooks/1",
            "Accept-Encoding": "identity",
            SIGNATURE_HEADER: sign(e.secret, body, int(time.time()), e.secret_previous),
            "Redpacket-Event-Id": str(c.seq),
            "Redpacket-Event-Type": c.event["type"],
        }
        name = e.label
        error = ""
        try:
            # httpx's timeout bounds each phase (connect, write, each read); the whole request, its
            # answer's reading included, is bounded here, so one never outlives its lease (a receiver
            # trickling its answer included).
            async with asyncio.timeout(self.settings.webhook_timeout_ms / 1000):
                status = await self.status_of(e.url, body, headers)
            if 200 <= status < 300:
                now = now_ms()
                if await deliveries.ack(self.core.db, endpoint, c.seq, token, now):
                    self.metrics.webhooks.deliveries.labels(name, "delivered").inc()
                    self.metrics.webhooks.latency.labels(name).observe((now - c.event["created_ms"]) / 1000)
                else:
                    self.metrics.webhooks.deliveries.labels(name, "lease_lost").inc()
                return
            error = f"HTTP {status}"
        except (httpx.TimeoutException, TimeoutError):
            error = "timed out"
        except (httpx.HTTPError, httpx.InvalidURL, httpx.StreamError) as x:
            # (An httpx error's text may quote the URL: its secrets are taken out before it is kept.)
            error = scrub(f"{type(x).__name__}: {x}", e.url)[:200]
        now = now_ms()
        give_up = now - c.first_ms >= self.settings.webhook_give_up_hours * 3_600_000
        wait = retry_after_ms(c.attempts, self.settings.webhook_retry_ms, self.rng)
        await deliveries.retry_later(
            self.core.db, endpoint, c.seq, token, next_ms=now + wait, error=error, give_up=give_up
        )
        self.metrics.webhooks.deliveries.labels(name, "failed" if give_up else "retry").inc()
        if time.monotonic() - self.warned.get(endpoint, -WARN_EVERY_S) >= WARN_EVERY_S:
            self.warned[endpoint] = time.monotonic()  # one line a minute per URL while it fails
            log.warning(
                "webhook to %s failed (event %d, try %d): %s; retried", name, c.seq, c.attempts, error
            )
        if give_up:
            log.error("webhook to %s gave up event %d after %d tries: %s", name, c.seq, c.attempts, error)

    async def observe(self, endpoint: str, url: str) -> None:
        self.observed[endpoint] = time.monotonic()
        q = await deliveries.state(self.core.db, endpoint)
        name = label(url)
        self.metrics.webhooks.pending.labels(name).set(q.pending)
        self.metrics.webhooks.failed.labels(name).set(q.failed)
        oldest = 0.0 if q.oldest_pending_ms is None else max(0.0, (now_ms() - q.oldest_pending_ms) / 1000)
        self.metrics.webhooks.oldest.labels(name).set(oldest)


async def _kept_for(core: Core, event: events.Event) -> str:
    """The span of the money move ``event`` reports, if one was kept (a send's, a grab's credit)."""
    data = event["data"]
    if event["type"] == "share.credited":
        key = keys.trace_of("grab", int(data["packet_id"]), int(data["seq"]))
    elif event["type"] == "packet.sent":
        key = keys.trace_of("send", int(data["packet_id"]))
    else:
        return ""
    return await tracing.kept(core.redis, key)  # (Redis away: '', the delivery in a trace of its own)
