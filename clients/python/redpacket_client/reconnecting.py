"""The Python client of the hub: one logical connection that survives drops (docs/integration.md, "The
Python client"). It keeps the last offset of every group, reconnects with capped exponential back-off and
full jitter, syncs again after every welcome once the app has synced, and turns what the hub can no
longer replay into a ``reset`` the app reloads from.

    client = await RedPacketClient.connect("ws://127.0.0.1:8000/ws", token, refresh_token=fetch_token)
    await client.sync()                    # from now on, after every reconnect too
    sent = await client.request("send", group=1, total=888, count=2, request_id="a1")
    message = await client.next_event()    # "event", "reset", "added", "removed", finally "closed"
    verdict = await client.verify(1, sent["packet_id"])  # once finished: "verified" (Provably fair)
    await client.close()

After a close (or a failed attempt) the client decides by the close code (``decide``): most codes are
retried; a bad token, an unknown user and a refusal before the upgrade are not. A request in flight
when the connection drops fails with ``HubError("disconnected")`` and is never sent again (a ``send``
carries a ``request_id`` so the app can retry it safely); a request with no reply within its timeout
fails with ``HubError("timeout")``.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

from websockets.exceptions import ConnectionClosed, InvalidStatus, InvalidURI

from redpacket_client.connection import HubClient, HubError
from redpacket_client.fairness import Verdict, verify
from redpacket_client.protocol import Format, offset_key

log = logging.getLogger("redpacket.client")

# Commitments kept, one a packet: the latest packets heard of (a few hundred KB at most).
COMMITMENTS_KEPT = 10_000

TokenSource = Callable[[], str | Awaitable[str]]
Action = Literal["retry", "refresh", "stop"]

# Codes after which the next attempt waits at least as after this many failures in a row (the hub asked
# us to slow down, or has no room for us yet), even right after a welcome.
PATIENT = {1013: 3, 4029: 4, 4030: 4}


@dataclass(frozen=True)
class Backoff:
    """The wait before attempt n+1 after n failed attempts in a row (a welcome starts over at 0): a
    uniformly random time in [0, min(maximum, initial·factorⁿ)] seconds ("full jitter"). ``attempts``:
    failed attempts in a row before giving up (None: never)."""

    initial: float = 0.5
    maximum: float = 30.0
    factor: float = 2.0
    attempts: int | None = None

    def delay(self, attempt: int, rng: random.Random) -> float:
        return rng.uniform(0, min(self.maximum, self.initial * self.factor ** min(attempt, 64)))


def decide(code: int | None, reason: str) -> Action:
    """What to do after a connection ended with ``code`` (a close code, or an HTTP status of a refused
    upgrade as ``-status``; None when none was made: refused, reset, no welcome in time)."""
    if code is None or code in (1000, 1001, 1006, 1011, 1012, 1013, 4002, 4008, 4029, 4030):
        return "retry"
    if code == 4001:  # token_expired: a fresh one helps; token_invalid (tampered, malformed): it never will
        return "refresh" if reason == "token_expired" else "stop"
    if code in (1008, 4004):  # refused by origin; a user the backend never put: not ours to fix by retrying
        return "stop"
    if code < 0:  # an HTTP answer instead of an upgrade: retry what is temporary
        return "retry" if -code in (408, 429) or -code >= 500 else "stop"
    return "retry"  # 1007, 1009 (a frame of ours refused: that request failed, not the client) and others


def stop_code(code: int | None, reason: str) -> str:
    """The code a stopped client reports: the hub's reason (``token_invalid``, ``user_not_found``), or
    ``http_403`` for an upgrade refused over HTTP, or ``close_1008``."""
    if code in (4001, 4004) and reason:
        return reason
    return f"http_{-code}" if code is not None and code < 0 else f"close_{code}"


class RedPacketClient:
    def __init__(
        self,
        url: str,
        token: str | None,
        *,
        refresh_token: TokenSource | None = None,
        fmt: Format = "msgpack",
        device: str | None = None,
        backoff: Backoff = Backoff(),
        request_timeout: float = 30.0,
        on_event: Callable[[dict[str, Any]], None] | None = None,
        rng: random.Random | None = None,
        **options: Any,
    ) -> None:
        if token is None and refresh_token is None:
            raise ValueError("give a token, a refresh_token callable, or both")
        self.url, self.fmt, self.device, self.options = url, fmt, device, options
        self.token = token
        self.refresh_token = refresh_token
        self.backoff = backoff
        self.request_timeout = request_timeout
        self.on_event = on_event
        self.rng = rng or random.Random()
        self.events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.offsets: dict[int, str] = {}  # the last offset seen per group, kept across connections
        # Each packet's commitment as heard before its seed was shown (``verify``), oldest first.
        self.commitments: dict[int, str] = {}
        self.groups: set[int] = set()
        self.welcome: dict[str, Any] = {}
        self.connections = 0  # welcomes so far
        self.closed: HubError | None = None  # why the client stopped for good
        self._conn: HubClient | None = None
        self._up = asyncio.Event()
        self._stopped = asyncio.Event()
        self._sync_all = False
        self._sync_some: set[int] = set()
        self._held: dict[int, list[dict[str, Any]]] = {}  # a group's events while its sync is answered
        self._tasks: set[asyncio.Task[Any]] = set()
        self._runner: asyncio.Task[None] | None = None
        self._last_close: tuple[int | None, str] = (None, "")  # how the last welcomed connection ended

    @classmethod
    async def connect(cls, url: str, token: str | None, **kwargs: Any) -> RedPacketClient:
        """Start the client and return once the first welcome came; raise ``HubError`` if it stopped
        first (a bad token, or ``Backoff.attempts`` failures in a row)."""
        client = cls(url, token, **kwargs)
        client.start()
        up = asyncio.create_task(client._up.wait())
        stopped = asyncio.create_task(client._stopped.wait())
        await asyncio.wait({up, stopped}, return_when=asyncio.FIRST_COMPLETED)
        up.cancel()
        stopped.cancel()
        if client.closed is not None:
            raise client.closed
        return client

    def start(self) -> None:
        if self._runner is None:
            self._runner = asyncio.create_task(self._run())

    async def __aenter__(self) -> RedPacketClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def connected(self) -> bool:
        return self._up.is_set()

    async def close(self) -> None:
        """Close for good: no reconnect, a last ``closed`` message (code ``closed``); a request in flight
        fails ``disconnected``, one waiting for a connection ``closed``."""
        self._finish(HubError("closed", "closed by the app"))
        for task in [*self._tasks, *([self._runner] if self._runner else [])]:
            task.cancel()
        if self._conn is not None:
            await self._conn.close()
        for task in [*self._tasks, *([self._runner] if self._runner else [])]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def wait_connected(self, timeout: float | None = None) -> None:
        """Wait until a connection is up (``HubError`` if the client stopped, ``timeout`` if not in time)."""
        await self._connection(timeout)

    async def next_event(self, timeout: float | None = 30) -> dict[str, Any]:
        return await asyncio.wait_for(self.events.get(), timeout)

    async def request(self, kind: str, /, timeout: float | None = None, **fields: Any) -> dict[str, Any]:
        """Send a request on the current connection (waiting for one while reconnecting) and return its
        reply's data. Raises ``HubError``: the reply's code, ``timeout`` when no reply came within
        ``timeout`` seconds (``request_timeout`` by default; waiting for a connection included),
        ``disconnected`` when the connection dropped before the reply (the request may have been done),
        or the reason the client stopped."""
        limit = self.request_timeout if timeout is None else timeout
        try:
            async with asyncio.timeout(limit):
                conn = await self._connection(None)
                data = await conn.request(kind, timeout=None, **fields)
        except TimeoutError:
            raise HubError("timeout", f"no reply to {kind} within {limit} s") from None
        except ConnectionClosed:
            raise HubError("disconnected", f"the connection dropped before the reply to {kind}") from None
        if kind in ("send", "open"):
            self._keep(data)
        return data

    def commitment(self, packet: int) -> str | None:
        """The packet's commitment as this client heard it before the seed was shown, if it did."""
        return self.commitments.get(packet)

    def _keep(self, packet: dict[str, Any]) -> None:
        """Keep a packet's commitment heard while its seed is secret (a send reply, a ``packet`` event, a
        view of it while active): the one a revealed seed must match (docs/protocol.md, "Keep the
        commitment"). The first heard stands; the oldest go past ``COMMITMENTS_KEPT``."""
        pid, committed = packet.get("packet_id"), packet.get("commitment")
        if not isinstance(pid, int) or not isinstance(committed, str) or packet.get("seed") is not None:
            return
        if pid not in self.commitments:
            self.commitments[pid] = committed
            while len(self.commitments) > COMMITMENTS_KEPT:
                del self.commitments[next(iter(self.commitments))]

    async def verify(self, group: int, packet: int) -> Verdict:
        """Open the packet and check its proof of a fair split (docs/protocol.md, "Provably fair
        packets") against the commitment this client kept (``commitment``): ``verified``, ``mismatch``
        (with each fault), ``not_verifiable`` (sent before packets were provably fair) or
        ``not_revealed`` (still active). ``Verdict.against_send`` says whether one was kept."""
        kept = self.commitment(packet)
        return verify(await self.request("open", group=group, packet=packet), kept)

    async def sync(self, groups: list[int] | None = None) -> dict[str, Any]:
        """Receive the groups' events (all of them: None) from the last offset seen, now and after every
        reconnect. Returns the sync's reply data; a group the hub can no longer replay also comes as a
        ``reset`` message before the events held for it."""
        if groups is None:
            self._sync_all = True
        else:
            self._sync_some.update(groups)
        try:
            conn = await self._connection(self.request_timeout)
            return await self._sync(
                conn, sorted(self.groups) if groups is None else groups, fresh_reset=False
            )
        except TimeoutError:
            raise HubError("timeout", "no reply to sync in time") from None
        except ConnectionClosed:
            raise HubError("disconnected", "the connection dropped before the reply to sync") from None

    # -- the connection's life -----------------------------------------------------------------------

    async def _connection(self, timeout: float | None) -> HubClient:
        if self.closed is None and not self._up.is_set():
            up = asyncio.create_task(self._up.wait())
            stopped = asyncio.create_task(self._stopped.wait())
            try:
                await asyncio.wait({up, stopped}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            finally:
                up.cancel()
                stopped.cancel()
        if self.closed is not None:
            raise HubError(self.closed.code, self.closed.message)
        if self._conn is None or not self._up.is_set():
            raise HubError("timeout", "no connection to the hub in time")
        return self._conn

    async def _run(self) -> None:
        failures = 0  # attempts in a row that came to no welcome
        first = True
        while self.closed is None:
            code, reason = await self._one_connection(first)
            if self.closed is not None:
                return
            if code == 0:  # a welcome came: the back-off starts over
                failures = 0
                code, reason = self._last_close
            action = decide(code, reason)
            log.info("hub connection ended (%s %s): %s", code, reason, action)
            if action == "stop" or (action == "refresh" and self.refresh_token is None):
                self._finish(HubError(stop_code(code, reason), f"the hub refused: {code} {reason}"))
                return
            if self.backoff.attempts is not None and failures >= self.backoff.attempts:
                self._finish(HubError("unreachable", f"gave up after {failures} attempts ({code} {reason})"))
                return
            await asyncio.sleep(self.backoff.delay(max(failures, PATIENT.get(code or 0, 0)), self.rng))
            failures += 1
            first = False

    async def _one_connection(self, first: bool) -> tuple[int | None, str]:
        """Open, welcome, re-sync and read until the connection ends: (0, "") if a welcome came (the close
        is in ``_last_close``), else what refused the attempt."""
        try:
            if self.refresh_token is not None and (self.token is None or not first):
                fresh = self.refresh_token()
                self.token = await fresh if inspect.isawaitable(fresh) else fresh
            assert self.token is not None
            conn = await HubClient.connect(
                self.url,
                self.token,
                self.fmt,
                self.device,
                on_event=self._on_event,
                on_notice=self._on_notice,
                offsets=self.offsets,
                welcome_timeout=self.request_timeout,
                **{"open_timeout": self.request_timeout, **self.options},
            )
        except ConnectionClosed as e:
            return (e.rcvd.code, e.rcvd.reason) if e.rcvd is not None else (None, str(e))
        except InvalidStatus as e:
            return -e.response.status_code, f"http {e.response.status_code}"
        except InvalidURI as e:  # not a websocket address: retrying will not help (1008: "stop")
            return 1008, str(e)
        except Exception as e:  # refused, reset, no welcome in time, a token refresh that failed
            log.warning("connecting to the hub failed: %r", e)
            return None, repr(e)
        self._conn = conn
        self._welcomed(conn)
        self._up.set()
        try:
            if self._sync_all or self._sync_some:
                wanted = self.groups if self._sync_all else self._sync_some & self.groups
                with contextlib.suppress(HubError, ConnectionClosed, TimeoutError):
                    await self._sync(conn, sorted(wanted), fresh_reset=True)
            await conn.wait_done()
        finally:
            self._up.clear()
            self._conn = None
            await conn.close()
        self._last_close = (conn.ws.close_code, conn.ws.close_reason or "")
        return 0, ""

    def _welcomed(self, conn: HubClient) -> None:
        """Take the welcome's groups as the truth: groups lost or gained while away are told to the app."""
        self.welcome = conn.welcome
        now = {int(g["group_id"]) for g in conn.welcome.get("groups", [])}
        if self.connections:
            for g in sorted(self.groups - now):
                self._forget(g)
                self._deliver({"type": "removed", "group": g})
            for g in sorted(now - self.groups):
                self._deliver({"type": "added", "group": g})
        self.groups = now
        self.connections += 1

    def _forget(self, group: int) -> None:
        self.offsets.pop(group, None)
        self._sync_some.discard(group)

    async def _sync(self, conn: HubClient, groups: list[int], fresh_reset: bool) -> dict[str, Any]:
        """One sync of ``groups`` from their offsets. Their events are held meanwhile so that a ``reset``
        comes before what the hub sent with it; ``fresh_reset``: a group synced from nothing (new to
        this client) is a reset too."""
        if not groups:
            return {"groups": {}}
        for g in groups:
            self._held.setdefault(g, [])
        try:
            data = await conn.request(
                "sync", groups={str(g): self.offsets.get(g) for g in groups}, timeout=self.request_timeout
            )
        finally:
            held = {g: self._held.pop(g, []) for g in groups}
        answers = data.get("groups", {})
        for g in groups:
            got = answers.get(str(g), {})
            if "error" in got:
                self._forget(g)
            elif got:
                for view in got.get("packets", []):
                    self._keep(view)
                latest = str(got["offset"])
                seen = self.offsets.get(g)
                if seen is None or offset_key(latest) > offset_key(seen):
                    self.offsets[g] = latest
                if got.get("too_old") or (fresh_reset and "packets" in got):
                    reset = {"type": "reset", "group": g, "offset": latest, "packets": got.get("packets", [])}
                    self._deliver(reset)
            for event in held[g]:
                self._deliver(event)
        return data

    # -- what the connection hears -------------------------------------------------------------------

    def _deliver(self, message: dict[str, Any]) -> None:
        if message.get("type") == "event" and message.get("event") == "packet":
            self._keep(message.get("data") or {})
        for view in message.get("packets", []) if message.get("type") == "reset" else []:
            self._keep(view)
        if self.on_event is None:
            self.events.put_nowait(message)
        else:
            self.on_event(message)

    def _on_event(self, event: dict[str, Any]) -> None:
        held = self._held.get(int(event["group"]))
        if held is None:
            self._deliver(event)
        else:
            held.append(event)

    def _on_notice(self, notice: dict[str, Any]) -> None:
        kind = notice.get("type")
        if kind == "removed":
            self.groups.discard(int(notice["group"]))
            self._forget(int(notice["group"]))
            self._deliver(notice)
        elif kind == "added":
            self.groups.add(int(notice["group"]))  # its events come live now
            self._deliver(notice)
        elif kind == "gap" and self._conn is not None:
            self._spawn(self._resync_gap(self._conn, int(notice["group"])))
        # welcome (read from the connection) and replies to requests that timed out: nothing to do

    async def _resync_gap(self, conn: HubClient, group: int) -> None:
        with contextlib.suppress(HubError, ConnectionClosed, TimeoutError):
            await self._sync(conn, [group], fresh_reset=False)

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _finish(self, why: HubError) -> None:
        """Stop for good; the app hears of it as its last message."""
        if self.closed is not None:
            return
        self.closed = why
        self._stopped.set()
        if why.code != "closed":
            log.warning("hub client stopped: %s", why.code)
        self._deliver({"type": "closed", "code": why.code, "message": why.message})
