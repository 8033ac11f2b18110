"""The demo page end to end in headless Chromium (Debian's ``chromium``, driven by Playwright).

Real hub (uvicorn, in this process, with the credit worker beside it as under ``redpacket up``), real
Redis and MariaDB. Two browser contexts are two users: a desktop admin and a phone-sized member.
Screenshots land in ``test-artifacts/``. Without Chromium these tests skip with the reason, unless
REDPACKET_TEST_REQUIRE_BROWSER=1 (CI sets it), in which case they fail.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from playwright.async_api import Browser, Page, async_playwright, expect

from server import ledger
from server.db import connect
from server.settings import Settings
from tests.hubtools import HubUnderTest, eventually, hub_in_process

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
PHONE = {"width": 390, "height": 844}
DESKTOP = {"width": 1200, "height": 800}
WAIT_MS = 15_000


@pytest.fixture(scope="module")
async def browser() -> AsyncIterator[Browser]:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        if os.environ.get("REDPACKET_TEST_REQUIRE_BROWSER") == "1":
            pytest.fail("Chromium is required (REDPACKET_TEST_REQUIRE_BROWSER=1): apt-get install chromium")
        pytest.skip("no Chromium: apt-get install chromium")
    async with async_playwright() as pw:
        b = await pw.chromium.launch(executable_path=exe, args=CHROMIUM_FLAGS)
        try:
            yield b
        finally:
            await b.close()


async def open_page(browser: Browser, url: str, viewport: dict[str, int]) -> Page:
    context = await browser.new_context(viewport=viewport)  # type: ignore[arg-type]
    context.set_default_timeout(WAIT_MS)
    page = await context.new_page()
    page.on("pageerror", lambda e: pytest.fail(f"error in the page: {e}"))
    await page.goto(url)
    return page


async def log_in(page: Page, name: str) -> None:
    await page.fill("#login-name", name)
    await page.click("#login-form button[type=submit]")
    await expect(page.locator("#conn")).to_have_attribute("data-state", "online", timeout=WAIT_MS)
    await expect(page.locator("#me-name")).to_have_text(name)


def yuan(cents: int) -> str:
    return f"¥{cents // 100}.{cents % 100:02d}"


async def ledger_amount(hub: HubUnderTest, packet_id: int, user_id: int) -> tuple[int, int]:
    """What the database says once the worker has credited the grab (waited for, within WAIT_MS: the
    page shows the amount from Redis first): the user's share of the packet, and the user's balance."""
    db = await connect(hub.settings.database_url)
    try:
        rows: list[tuple[object, ...]] = []

        async def credited() -> bool:
            rows[:] = await db.fetchall(
                "SELECT amount FROM grab_records"
                " WHERE packet_id = %s AND user_id = %s AND status = 'credited'",
                (packet_id, user_id),
            )
            return bool(rows)

        await eventually(credited, timeout=WAIT_MS / 1000)
        return int(rows[0][0]), await ledger.balance(db, user_id)  # type: ignore[call-overload]
    finally:
        await db.close()


async def pair_in_group(hub: HubUnderTest, name: str) -> tuple[str, int, int]:
    """Over the HTTP API: alice (admin, ¥50) and bob in a new group. Alice's token, bob's id, the group."""
    _, alice_token = await hub.login("alice")
    bob, _ = await hub.login("bob")
    await hub.api("POST", "/api/topup", alice_token, amount=5_000, request_id="t1")
    group = (await hub.api("POST", "/api/groups", alice_token, name=name))["group_id"]
    await hub.api("POST", f"/api/groups/{group}/members", alice_token, user_ids=[bob])
    return alice_token, bob, int(group)


async def test_admin_sends_member_grabs_both_see_it_and_the_balance_rises(
    browser: Browser, hub_settings: Settings
) -> None:
    async with hub_in_process(hub_settings, run_worker=True) as hub:
        admin = await open_page(browser, hub.http, DESKTOP)
        member = await open_page(browser, hub.http, PHONE)
        await log_in(admin, "alice")
        await log_in(member, "bob")
        bob_id = int(await member.evaluate("state.me.user_id"))

        # The admin tops up, creates a group and adds bob, all through the page.
        await admin.click("#topup")
        await expect(admin.locator("#balance")).to_have_text("¥100.00")
        await admin.fill("#new-group-name", "family")
        await admin.click("#new-group button[type=submit]")
        await expect(admin.locator("#group-title")).to_have_text("family")
        await admin.fill("#add-names", "bob")
        await admin.click("#add-member button[type=submit]")
        await expect(admin.locator(f"#member-list li[data-user='{bob_id}']")).to_contain_text("bob")

        # Bob's phone shows the new group live (no reload); he opens it.
        await member.click("#group-list button:has-text('family')")
        await expect(member.locator("#group-title")).to_have_text("family")
        # A member of a group where only admins send has no packet button.
        await expect(member.locator("#open-send")).to_be_hidden()

        # A packet larger than the balance is refused in words, and moves no money.
        await admin.click("#open-send")
        await admin.fill("#send-total", "150")
        await admin.fill("#send-count", "2")
        await admin.click("#send-submit")
        await expect(admin.locator("#send-error")).to_contain_text("Not enough balance")
        await expect(admin.locator("#balance")).to_have_text("¥100.00")

        await admin.fill("#send-total", "8.88")
        await admin.fill("#send-greeting", "Happy new year")
        await admin.click("#send-submit")
        await expect(admin.locator("#send-dialog")).not_to_be_visible()
        await expect(admin.locator("#balance")).to_have_text("¥91.12")

        # Bob sees the red bubble arrive and taps it: his amount and the grab list.
        bubble = member.locator(".packet").first
        await expect(bubble).to_contain_text("Happy new year")
        await expect(bubble).to_contain_text("Tap to open")
        packet_id = int(await bubble.get_attribute("data-packet") or 0)
        await bubble.click()
        await expect(member.locator("#packet-dialog")).to_be_visible()
        await expect(member.locator("#pd-amount")).to_have_text(re.compile(r"^¥\d+\.\d\d$"))
        shown = await member.locator("#pd-amount").inner_text()
        share, _ = await ledger_amount(hub, packet_id, bob_id)
        assert shown == yuan(share)
        await expect(member.locator(f"#pd-grabs li[data-user='{bob_id}']")).to_contain_text(yuan(share))

        # The admin's room shows bob's grab as it happens; she grabs the last share herself.
        await expect(admin.locator("#messages")).to_contain_text("bob grabbed a red packet, 1 of 2 left")
        await admin.locator(f".packet[data-packet='{packet_id}']").click()
        await expect(admin.locator("#pd-grabs li")).to_have_count(2)
        await expect(admin.locator("#pd-summary")).to_contain_text("all grabbed in")
        await expect(admin.locator("#pd-grabs .best")).to_have_count(1)
        await expect(admin.locator("#messages")).to_contain_text("All 2 shares grabbed")
        alice_share = 888 - share
        await expect(admin.locator("#pd-amount")).to_have_text(yuan(alice_share))
        best = bob_id if share > alice_share else None
        if best is not None:
            await expect(admin.locator(f"#pd-grabs li[data-user='{bob_id}'] .best")).to_have_count(1)

        # Bob's balance rises by exactly what the ledger credited, once the worker has.
        await expect(member.locator("#balance")).to_have_text(yuan(share), timeout=WAIT_MS)
        _, bob_balance = await ledger_amount(hub, packet_id, bob_id)
        assert bob_balance == share
        await member.locator("#packet-close").click()
        await expect(member.locator("#messages")).to_contain_text("All 2 shares grabbed")

        # A packet for bob alone: alice picks him in the send dialog; she cannot take it herself.
        await admin.locator("#packet-close").click()
        await admin.click("#open-send")
        await admin.check("input[name=kind][value=exclusive]")
        await expect(admin.locator("#send-count-row")).to_be_hidden()
        await admin.select_option("#send-target", label="bob")
        await admin.fill("#send-total", "1")
        await admin.fill("#send-greeting", "just for you")
        await admin.click("#send-submit")
        await expect(admin.locator("#send-dialog")).not_to_be_visible()
        mine_only = admin.locator(".packet", has_text="just for you")
        await expect(mine_only).to_contain_text("for bob")
        await expect(member.locator(".packet", has_text="just for you")).to_contain_text("for you")
        await mine_only.click()
        await expect(admin.locator("#pd-note")).to_have_text("This red packet is for someone else.")
        await admin.locator("#packet-close").click()
        await member.locator(".packet", has_text="just for you").click()
        await expect(member.locator("#pd-amount")).to_have_text("¥1.00")
        await member.locator("#packet-close").click()
        await expect(member.locator("#balance")).to_have_text(yuan(share + 100), timeout=WAIT_MS)
        assert (await ledger_amount(hub, packet_id, bob_id))[1] == share + 100

        # "My packets": what bob received, where it stands; what alice sent.
        await member.click("#back")
        await member.click("#my-packets")
        received = member.locator(f"#history-received li[data-packet='{packet_id}']")
        await expect(received).to_contain_text(yuan(share))
        await expect(received).to_contain_text("in your balance")
        await expect(member.locator("#history-received li")).to_have_count(2)
        await admin.click("#my-packets")
        sent_row = admin.locator(f"#history-sent li[data-packet='{packet_id}']")
        await expect(sent_row).to_contain_text("¥8.88")
        await expect(sent_row).to_contain_text(re.compile("2 of 2 paid out|all paid out"))
        await expect(admin.locator("#history-sent li")).to_have_count(2)

        ARTIFACTS.mkdir(exist_ok=True)
        await admin.screenshot(path=str(ARTIFACTS / "web-admin.png"))
        await member.screenshot(path=str(ARTIFACTS / "web-member.png"))
        await admin.context.close()
        await member.context.close()


class Proxy:
    """A TCP proxy in front of the hub that the test can cut (every connection dropped, new ones
    refused at once) and restore: a real network drop as the browser sees it."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.up = True
        self.writers: set[asyncio.StreamWriter] = set()
        self.port = 0

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.transport.abort()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.up:
            writer.transport.abort()
            return
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        self.writers |= {writer, up_writer}
        try:
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        finally:
            self.writers -= {writer, up_writer}

    def cut(self) -> None:
        self.up = False
        for w in list(self.writers):
            w.transport.abort()

    def restore(self) -> None:
        self.up = True

    @asynccontextmanager
    async def running(self) -> AsyncIterator[Proxy]:
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        try:
            yield self
        finally:
            self.cut()
            server.close()
            await server.wait_closed()


async def test_a_dropped_connection_shows_reconnects_and_fills_in_what_was_missed(
    browser: Browser, hub_settings: Settings
) -> None:
    async with hub_in_process(hub_settings, run_worker=True) as hub:
        alice_token, _, group = await pair_in_group(hub, "friends")
        sender = await hub.client(alice_token, fmt="json")
        await sender.request("chat", group=group, text="before the drop")

        port = int(hub.http.rsplit(":", 1)[1])
        async with Proxy(port).running() as proxy:
            page = await open_page(browser, f"http://127.0.0.1:{proxy.port}", DESKTOP)
            await log_in(page, "bob")
            await page.click("#group-list button:has-text('friends')")
            await expect(page.locator("#messages")).to_contain_text("before the drop")

            proxy.cut()
            await expect(page.locator("#conn")).to_have_attribute("data-state", "reconnecting")
            await expect(page.locator("#conn")).to_have_text("Reconnecting…")
            await expect(page.locator("#missed")).to_contain_text("Connection lost")
            await expect(page.locator("#composer button[type=submit]")).to_be_disabled()
            ARTIFACTS.mkdir(exist_ok=True)
            await page.screenshot(path=str(ARTIFACTS / "web-reconnecting.png"))

            # While bob is away: a message and a packet.
            await sender.request("chat", group=group, text="while you were away")
            sent = await sender.request("send", group=group, total=300, count=1, greeting="for bob")

            proxy.restore()
            await expect(page.locator("#conn")).to_have_attribute("data-state", "online", timeout=WAIT_MS)
            await expect(page.locator("#messages")).to_contain_text("while you were away")
            bubble = page.locator(f".packet[data-packet='{sent['packet_id']}']")
            await expect(bubble).to_contain_text("for bob")
            await expect(page.locator("#toast")).to_contain_text("2 missed updates filled in")
            await expect(page.locator("#missed")).to_be_hidden()
            # Nothing shown twice: one copy of the message from before the drop.
            await expect(page.locator("#messages li", has_text="before the drop")).to_have_count(1)

            # And the page works as before: bob grabs the packet sent while he was away.
            await bubble.click()
            await expect(page.locator("#pd-amount")).to_have_text("¥3.00")
            await page.screenshot(path=str(ARTIFACTS / "web-reconnected.png"))
            await page.context.close()
        await sender.close()


async def test_refusals_are_shown_in_words_and_removal_takes_effect_on_the_page(
    browser: Browser, hub_settings: Settings
) -> None:
    # Packets that expire two seconds after they are sent; one grab attempt per user, then a long wait.
    s = hub_settings.with_(packet_ttl_seconds=2, grabs_per_second=0.001, grabs_burst=1)
    async with hub_in_process(s, run_worker=True) as hub:
        alice_token, bob, group = await pair_in_group(hub, "club")
        sender = await hub.client(alice_token, fmt="json")

        page = await open_page(browser, hub.http, PHONE)
        await log_in(page, "bob")
        await page.click("#group-list button:has-text('club')")
        sent = await sender.request("send", group=group, total=500, count=2, greeting="too slow")
        bubble = page.locator(f".packet[data-packet='{sent['packet_id']}']")
        await expect(bubble).to_contain_text("Tap to open")
        await page.wait_for_function(f"Date.now() > {sent['expires_ms']} + 100")

        # Tapping an expired packet: a sentence, no amount, nothing credited.
        await bubble.click()
        await expect(page.locator("#pd-note")).to_have_text("This red packet has expired.")
        await expect(page.locator("#pd-amount")).to_be_empty()
        assert await hub.api("GET", "/api/me", (await hub.login("bob"))[1]) == {
            "user_id": bob,
            "name": "bob",
            "balance": 0,
            "groups": [
                {"group_id": group, "name": "club", "role": "member", "members_can_send": False, "members": 2}
            ],
        }
        await page.click("#packet-close")

        # Too many grabs: said in words, and the packet stays closed for the next try.
        fresh = await sender.request("send", group=group, total=300, count=1, greeting="next one")
        next_bubble = page.locator(f".packet[data-packet='{fresh['packet_id']}']")
        await next_bubble.click()
        too_fast = "You are going too fast. Wait a moment and try again."
        await expect(page.locator("#toast")).to_have_text(too_fast)
        await expect(page.locator("#packet-dialog")).not_to_be_visible()
        await expect(next_bubble).to_contain_text("Tap to open")

        # Removed by the admin while looking at the group: the page says so and the group is gone.
        await hub.api("DELETE", f"/api/groups/{group}/members/{bob}", alice_token)
        await expect(page.locator("#toast")).to_have_text("You were removed from a group.")
        await expect(page.locator("#group-list button:has-text('club')")).to_have_count(0)
        await expect(page.locator("#composer")).to_be_hidden()
        ARTIFACTS.mkdir(exist_ok=True)
        await page.screenshot(path=str(ARTIFACTS / "web-removed.png"))
        await page.context.close()
        await sender.close()
