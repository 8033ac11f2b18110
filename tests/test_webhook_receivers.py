"""Webhook receivers that misbehave cannot take a worker down, and a URL's secrets are never shown.

A real ``redpacket worker`` process delivers to receivers answering a gzip bomb (200 KB inflating to
200 MB), a slowloris body (a byte every 50 ms) and a 10 MB plain body, and to the same with its credits to
pay: its memory stays under 100 MB above its baseline (read from /proc while it runs; the worker is killed
at once past the bound, so a regression fails the test without taking the machine's memory), and grabs are
credited meanwhile. A URL's ``user:password@`` and query are in no line a worker or ``redpacket up``
writes, in no stored error, in ``redpacket webhooks status`` and in the service API.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import re
import secrets
import signal
import subprocess
import sys
import zlib
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from server.core import Core
from server.money import grabs, ledger, packets
from server.money.endpoints import label, scrub
from tests.clitools import redpacket
from tests.conftest import bulk_users, make_world
from tests.hubtools import eventually, redpacket_up, worker_env
from tests.webhooktools import SECRET

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RSS from /proc")

MB = 1024 * 1024
BOUND = 100 * MB  # the most a worker may grow over its baseline, whatever its receivers do
USER, PASSWORD, TOKEN = "hookuser", "pw-of-the-receiver-7f3a9c", "tok-of-the-receiver-51be02"
SECRETS = (PASSWORD, TOKEN)


def gzip_bomb(inflated: int = 200 * MB) -> bytes:
    """``inflated`` zero bytes, gzipped (about a thousandth of it), made a megabyte at a time."""
    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    chunk = bytes(MB)
    return b"".join([*(z.compress(chunk) for _ in range(inflated // MB)), z.flush()])


@dataclass
class Hostile:
    """Receivers on one port, by path: ``/bomb``, ``/slow``, ``/big``, ``/echo`` (a status line quoting
    the request's, as a broken proxy might: the httpx error then quotes the URL's query). Polite (204)
    until ``hostile`` is set (except ``/echo``)."""

    bomb: bytes = b""
    hostile: bool = False
    calls: collections.Counter[str] = field(default_factory=collections.Counter)
    port: int = 0

    def url(self, path: str, secret: bool = False) -> str:
        auth = f"{USER}:{PASSWORD}@" if secret else ""
        return f"http://{auth}127.0.0.1:{self.port}/{path}" + (f"?token={TOKEN}" if secret else "")

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            line = head.split(b"\r\n", 1)[0]
            kind = line.split(b" ")[1].split(b"?")[0].strip(b"/").decode()
            length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
            await reader.readexactly(int(length[1]) if length else 0)
            self.calls[kind] += 1
            if kind == "echo":
                writer.write(line + b"\r\n\r\n")
            elif not self.hostile:
                writer.write(b"HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n")
            elif kind == "bomb":
                await self.body(writer, len(self.bomb), [self.bomb], b"Content-Encoding: gzip\r\n")
            elif kind == "big":
                await self.body(writer, 10 * MB, (bytes(64 * 1024) for _ in range(160)))
            elif kind == "slow":
                await self.body(writer, MB, (b"x" for _ in range(MB)), pause=0.05)
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the worker cut the answer off: what it should do
        finally:
            writer.close()

    @staticmethod
    async def body(
        writer: asyncio.StreamWriter,
        size: int,
        parts: Iterable[bytes],
        extra: bytes = b"",
        pause: float = 0.0,
    ) -> None:
        """A 200 of ``size`` bytes, written a piece at a time as the worker reads (never buffered whole
        here), a piece every ``pause`` seconds for a slowloris."""
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: %d\r\n%b\r\n" % (size, extra))
        for part in parts:
            for at in range(0, len(part), 64 * 1024):
                if writer.is_closing():
                    return
                writer.write(part[at : at + 64 * 1024])
                await writer.drain()
            if pause:
                await asyncio.sleep(pause)  # (the receiver's trickle, not a wait in the test)


@contextlib.asynccontextmanager
async def hostile_receivers() -> AsyncIterator[Hostile]:
    h = Hostile(bomb=await asyncio.to_thread(gzip_bomb))
    assert len(h.bomb) < 300 * 1024
    server = await asyncio.start_server(h.handle, "127.0.0.1", 0)
    h.port = server.sockets[0].getsockname()[1]
    try:
        yield h
    finally:
        server.close()


def rss(pid: int) -> int:
    """A process's resident memory, in bytes (0 once it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return 0
    m = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
    return int(m[1]) * 1024 if m else 0


@dataclass
class Watch:
    """The peak RSS of a process over its baseline; past ``BOUND`` it is killed at once (a test that
    fails must not take the machine's memory with it)."""

    pid: int
    baseline: int
    peak: int = 0
    killed: bool = False

    async def run(self) -> None:
        while not self.killed:
            now = rss(self.pid)
            self.peak = max(self.peak, now - self.baseline)
            if now and now - self.baseline > BOUND:
                os.kill(self.pid, signal.SIGKILL)
                self.killed = True
            await asyncio.sleep(0.01)  # (a sampling period: nothing is waited for)


async def _balance_is(core: Core, user: int, cents: int) -> bool:
    return await ledger.balance(core.db, user) == cents


@pytest.mark.parametrize("core", ["mysql"], indirect=True)
async def test_a_worker_stays_bounded_and_keeps_crediting_under_hostile_receivers(
    core: Core, tmp_path: Path
) -> None:
    w = await make_world(core, members=2, admin_cents=100_000)
    async with hostile_receivers() as rx:
        env = {
            **worker_env(core.settings),
            "REDPACKET_WEBHOOK_URLS": ",".join([rx.url("bomb", secret=True), rx.url("slow"), rx.url("big")]),
            "REDPACKET_WEBHOOK_SECRET": SECRET,
            "REDPACKET_WEBHOOK_TIMEOUT_MS": "2000",
            "REDPACKET_WEBHOOK_RETRY_MS": "20",
        }
        log = tmp_path / "worker.log"
        with log.open("wb") as out:
            worker = subprocess.Popen(  # noqa: ASYNC220 - the one worker process under test
                [sys.executable, "-m", "server", "worker"], env=env, stdout=out, stderr=out
            )
        watch: Watch | None = None
        watching: asyncio.Task[None] | None = None
        try:
            # Up and paying, its receivers polite: the baseline.
            p = await packets.send_packet(
                core, sender_id=w.admin, group_id=w.group, kind="equal", total=200, count=2
            )
            await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=w.members[0])
            await eventually(lambda: _balance_is(core, w.members[0], 100), timeout=60)
            await eventually(lambda: min(rx.calls[k] for k in ("bomb", "slow", "big")) >= 3, timeout=60)
            watch = Watch(worker.pid, rss(worker.pid))
            watching = asyncio.create_task(watch.run())
            # Hostile now, with 300 events of 150 users to deliver (50 at a time per URL).
            rx.hostile = True
            users = await bulk_users(core.db, "h", 150)
            for i in range(300):
                await ledger.topup(core.db, users[i % 150], 100, f"hostile-{i}")
            await eventually(lambda: rx.calls["bomb"] >= 40 or watch.killed, timeout=120)
            # Grabs made while the receivers are being called are credited.
            before = sum(rx.calls.values())
            await grabs.grab(core, packet_id=p.packet_id, group_id=w.group, user_id=w.members[1])

            async def credited_or_killed() -> bool:
                return watch.killed or await _balance_is(core, w.members[1], 100)

            await eventually(credited_or_killed, timeout=60)
            assert not watch.killed, f"the worker grew {watch.peak // MB} MB over its baseline: killed"
            assert await _balance_is(core, w.members[1], 100)
            await eventually(
                lambda: (
                    (rx.calls["bomb"] >= 150 and rx.calls["big"] >= 150 and rx.calls["slow"] >= 100)
                    or watch.killed
                ),
                timeout=180,
            )
            assert not watch.killed, f"the worker grew {watch.peak // MB} MB over its baseline: killed"
            assert sum(rx.calls.values()) > before  # they were still being called after the credit
            print(
                f"RSS baseline {watch.baseline / MB:.0f} MB, peak {watch.peak / MB:.1f} MB over it;",
                dict(rx.calls),
            )
            assert watch.peak < BOUND
        finally:
            if watching is not None:
                watching.cancel()
            worker.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(worker.wait, 30)
            except subprocess.TimeoutExpired:
                worker.kill()
                await asyncio.to_thread(worker.wait, 30)
        said = log.read_text()
        assert "Traceback" not in said, said[-5000:]
        for secret in SECRETS:  # httpx's INFO line (a line per delivery, with the URL) is off in a worker
            assert secret not in said, said[-5000:]
        row = await core.db.fetchone(
            "SELECT COUNT(*) FROM webhook_deliveries WHERE last_error LIKE %s", ("%tok-%",)
        )
        assert row is not None and int(row[0]) == 0


def test_a_url_is_shown_without_its_secrets() -> None:
    url = f"https://{USER}:{PASSWORD}@hooks.example:8443/in/{secrets.token_hex(2)}?token={TOKEN}&x=1"
    shown = label(url)
    assert shown.startswith("hooks.example:8443/in/") and USER not in shown
    assert all(s not in shown for s in SECRETS) and "?" not in shown
    encoded = TOKEN.replace("-", "%2D")  # a library's own spelling of it
    quoted = url.replace(TOKEN, encoded)
    said = f"ConnectError for {url}; b'POST /in?token={TOKEN} HTTP/1.1'; {quoted}; alone: {encoded} {TOKEN}"
    text = scrub(said, url)
    spellings = (*SECRETS, encoded, PASSWORD.replace("-", "%2D"))
    assert all(s not in text for s in spellings) and USER not in text, text
    # Short query values are not hunted through the text: an address stays readable.
    assert "127.0.0.1 HTTP/1.1" in scrub("to 127.0.0.1 HTTP/1.1", url)
    assert label("http://127.0.0.1:notaport/h") == "127.0.0.1/h"


def test_a_token_in_a_urls_path_is_not_shown() -> None:
    """Slack's and Discord's webhook URLs carry their token in the path: a long path segment is shown as
    ``***`` and hunted through a text like a query's token; the short segments (ids, names) stay readable."""
    token = secrets.token_urlsafe(18)  # (24 characters, as Slack's)
    url = f"https://hooks.slack.com/services/T0AB12CD3/B0EF45GH6/{token}"
    assert label(url) == "hooks.slack.com/services/T0AB12CD3/B0EF45GH6/***"
    said = f"POST {url.replace('https', 'http')} failed; {token}; {token.replace('-', '%2D')}"
    text = scrub(said, url)
    assert token not in text and "T0AB12CD3" in text, text
    assert label("https://rx.example/webhooks/redpacket") == "rx.example/webhooks/redpacket"
    # Discord's: its id (all digits) stays, so two endpoints keep two labels; its token does not.
    discord = f"https://discord.com/api/webhooks/123456789012345678/{secrets.token_urlsafe(51)}"
    assert label(discord) == "discord.com/api/webhooks/123456789012345678/***"
    # A library's lower-case escapes of the token are found too.
    odd = "Tok_en-abcdefghijkl"
    text = scrub(f"failed: {odd.replace('_', '%5f').replace('-', '%2d')}", f"https://rx.example/in/{odd}")
    assert "abcdefghijkl" not in text, text


async def test_no_secret_of_a_url_in_up_its_log_its_errors_its_cli_or_its_api(tmp_path: Path) -> None:
    """``redpacket up`` (its worker in the hub's process) delivers to a receiver that takes the event,
    one whose answer makes httpx quote the request line (its query) in its error, and a closed port:
    none of the URLs' secrets in what ``up`` writes, in the stored last errors, in ``redpacket webhooks
    status`` or in the service API's deliveries."""
    from tests.hubtools import free_port

    key = secrets.token_hex(32)
    async with hostile_receivers() as rx:
        closed = f"http://{USER}:{PASSWORD}@127.0.0.1:{free_port()}/gone?token={TOKEN}"
        urls = [rx.url("bomb", secret=True), rx.url("echo", secret=True), closed]
        env = {
            "REDPACKET_SERVICE_KEY": key,
            "REDPACKET_WEBHOOK_URLS": ",".join(urls),
            "REDPACKET_WEBHOOK_SECRET": SECRET,
            "REDPACKET_WEBHOOK_RETRY_MS": "20",
        }
        said: list[str] = []
        auth = {"authorization": f"Bearer {key}"}
        with redpacket_up(tmp_path / "data", env=env, said=said) as (url, _):
            async with httpx.AsyncClient(base_url=url, headers=auth, timeout=30) as http:
                assert (await http.put("/api/service/users/7", json={"name": "qi"})).status_code == 200
                r = await http.post("/api/service/topup", json={"user_id": 7, "amount": 5, "request_id": "q"})
                assert r.status_code == 200
                await eventually(lambda: rx.calls["bomb"] >= 1 and rx.calls["echo"] >= 2, timeout=60)
                hooks = (await http.get("/api/service/webhooks")).json()["webhooks"]
                assert [h["url"] for h in hooks] == [label(u) for u in urls]
                errors = []
                for h in hooks[1:]:

                    async def failed_once(h: dict[str, object] = h) -> bool:
                        page = (await http.get(f"/api/service/webhooks/{h['id']}/deliveries")).json()
                        errors.extend(d["last_error"] for d in page["deliveries"] if d["last_error"])
                        return bool(errors)

                    await eventually(failed_once, timeout=60)
                text = str(hooks) + str(errors)
                assert "RemoteProtocolError" in text and "ConnectError" in text, text
            status = await asyncio.to_thread(
                redpacket, "webhooks", "status", **env, REDPACKET_DATA_DIR=str(tmp_path / "data")
            )
        assert status.returncode == 0, status.stderr
        assert label(urls[0]) in status.stdout
        for secret in SECRETS:
            assert secret not in text, text
            assert secret not in "".join(said), "".join(said)[-5000:]
            assert secret not in status.stdout + status.stderr, status.stdout
