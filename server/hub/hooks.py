"""The chat backend's say before money moves (``REDPACKET_HOOK_URL``): risk control, KYC, spending limits.

Before a send (from a socket or ``POST /api/service/packets``) and before a withdrawal or a hold — once
its fields are checked, before the balance and membership checks and any money moving — the hub
POSTs what is asked to the hook — ``{"type": "send" | "withdraw" | "hold", "user_id", ...}``, signed as
webhooks are (``server.signing``) — and waits at most ``REDPACKET_HOOK_TIMEOUT_MS`` for its answer:

- ``{"allow": true}``: go on; a send may come back with a changed ``greeting`` (moderation), checked as
  any greeting;
- ``{"allow": false, "reason": "<your code>", "message": "<for the user>"}``: refused
  ``denied_by_backend`` (403) with that reason and message; nothing is paid;
- no answer in time, an error, anything else: ``hook_unavailable`` (503) for money out, always; for a
  send, as ``REDPACKET_HOOK_SENDS_WHEN_DOWN`` says (``deny``, the default, or ``allow``: sent unchecked).

A retry of something already done (its request id paid before) is not asked again: it answers what was
done. Not before a grab: a grab moves no money out of the system, its amount was decided and paid for at
the send, and it is the storm's hot path (one HTTP round trip more per grab would be most of its cost);
the bot detector gates grabs. Each call's time and answer are counted (``redpacket_hook_seconds``,
``redpacket_hook_answers_total``).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any, Literal, assert_never

import httpx

from server import errors
from server.core import Core
from server.errors import Forbidden, Unavailable
from server.hub.metrics import HubMetrics
from server.ids import GroupId, UserId
from server.money import packets, payouts
from server.money.split import PacketRequest
from server.signing import SIGNATURE_HEADER, sign

Asked = Literal["send", "withdraw", "hold"]
# The most of an answer read: a verdict is a few fields.
ANSWER_BYTES = 4096


@dataclass(frozen=True, slots=True)
class Allowed:
    greeting: str | None = None  # a send's greeting as the backend changed it


@dataclass(frozen=True, slots=True)
class Denied:
    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class NoAnswer:
    why: str


# What the hook said: every caller handles each (``match`` + ``assert_never``).
Verdict = Allowed | Denied | NoAnswer


def read_answer(status: int, body: bytes) -> Verdict:
    """The verdict in a hook's HTTP answer; anything but a 2xx JSON object with a boolean ``allow`` is
    no answer."""
    if not 200 <= status < 300:
        return NoAnswer(f"HTTP {status}")
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # (nested past the parser's depth: no verdict either)
        return NoAnswer("not JSON")
    if not isinstance(data, dict) or not isinstance(data.get("allow"), bool):
        return NoAnswer('no boolean "allow"')
    if data["allow"]:
        greeting = data.get("greeting")
        return Allowed(greeting if isinstance(greeting, str) else None)
    reason, message = data.get("reason"), data.get("message")
    return Denied(
        reason if isinstance(reason, str) and 0 < len(reason) <= 64 else "denied",
        message[:200] if isinstance(message, str) and message else "the chat service declined this",
    )


class Hooks:
    """The hub's calls to ``REDPACKET_HOOK_URL`` (none when it is unset: every ``approve_*`` is then a
    no-op)."""

    def __init__(self, core: Core, metrics: HubMetrics) -> None:
        s = core.settings
        self.core, self.metrics = core, metrics
        self.url, self.secret = s.hook_url, s.hook_secret
        self.timeout = s.hook_timeout_ms / 1000
        self.sends_when_down = s.hook_sends_when_down
        self.client: httpx.AsyncClient | None = None

    async def __aenter__(self) -> Hooks:
        if self.url:
            # (identity: only the verdict is read, and at most ANSWER_BYTES of it)
            self.client = httpx.AsyncClient(
                timeout=self.timeout, headers={"Accept-Encoding": "identity"}, follow_redirects=False
            )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.client is not None:
            await self.client.aclose()

    async def ask(self, asked: Asked, question: dict[str, Any]) -> Verdict:
        """One call to the hook, bounded by the timeout as a whole; its verdict, counted."""
        assert self.client is not None
        body = json.dumps({"type": asked, **question}, separators=(",", ":")).encode()
        headers = {
            "Content-Type": "application/json",
            "User-Agent": "redpacket-hooks/1",
            SIGNATURE_HEADER: sign(self.secret, body, int(time.time())),
        }
        started = time.perf_counter()
        try:
            async with asyncio.timeout(self.timeout):
                async with self.client.stream("POST", self.url, content=body, headers=headers) as r:
                    answer = b""
                    async for chunk in r.aiter_raw():
                        answer += chunk
                        if len(answer) > ANSWER_BYTES:
                            break
                    verdict = read_answer(r.status_code, answer[:ANSWER_BYTES])
        except (httpx.HTTPError, TimeoutError) as e:
            verdict = NoAnswer(type(e).__name__)
        self.metrics.hook_seconds.labels(asked).observe(time.perf_counter() - started)
        match verdict:
            case Allowed(greeting=None):
                self.metrics.hook_answers.labels(asked, "allowed").inc()
            case Allowed():
                self.metrics.hook_answers.labels(asked, "changed").inc()
            case Denied():
                self.metrics.hook_answers.labels(asked, "denied").inc()
            case NoAnswer():
                self.metrics.hook_answers.labels(asked, "no_answer").inc()
            case _:
                assert_never(verdict)
        return verdict

    async def approve_send(
        self, req: PacketRequest, request_id: str, *, sender_id: UserId, group_id: GroupId
    ) -> str | None:
        """Ask the hook about a send already checked (``packets.send_packet`` calls it before any money
        moves): None to go on as asked, a changed greeting, or raise ``denied_by_backend`` /
        ``hook_unavailable``. A send done before with this request id is not asked again: it is answered
        as it was sent, with the greeting the hook may have given it then."""
        if self.client is None:
            return None
        earlier = await packets.greeting_sent_before(self.core.db, sender_id, request_id)
        if earlier is not None:
            return earlier
        question = {
            "user_id": sender_id,
            "group_id": group_id,
            "kind": req.kind,
            "total": req.total,
            "count": req.count,
            "greeting": req.greeting,
            "target": req.target_user_id,
            "request_id": request_id,
        }
        verdict = await self.ask("send", question)
        match verdict:
            case Allowed(greeting=greeting):
                return greeting
            case Denied(reason=reason, message=message):
                raise Forbidden(errors.DENIED_BY_BACKEND, message, reason=reason)
            case NoAnswer(why=why):
                if self.sends_when_down == "allow":
                    return None
                raise Unavailable(errors.HOOK_UNAVAILABLE, f"the chat service's check did not answer ({why})")
            case _:
                assert_never(verdict)

    async def approve_payout(
        self, asked: Literal["withdraw", "hold"], user_id: UserId, cents: int, rid: str
    ) -> None:
        """Ask the hook about money leaving (a withdrawal, a hold): go on, or raise ``denied_by_backend``
        / ``hook_unavailable`` — never out without a yes. One done before with this request id is not
        asked again."""
        if self.client is None or await payouts.paid_out_before(self.core.db, user_id, asked, rid):
            return
        verdict = await self.ask(asked, {"user_id": user_id, "amount": cents, "request_id": rid})
        match verdict:
            case Allowed():
                return
            case Denied(reason=reason, message=message):
                raise Forbidden(errors.DENIED_BY_BACKEND, message, reason=reason)
            case NoAnswer(why=why):
                raise Unavailable(errors.HOOK_UNAVAILABLE, f"the chat service's check did not answer ({why})")
            case _:
                assert_never(verdict)
