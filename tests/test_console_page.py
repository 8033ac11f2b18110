"""The operators' console in a real browser, by keyboard: support answers "where is my money?" for a
grabber told "won" whose credit waits or was refused, and for a sender whose packet expired, and "was it
fair?" for a finished packet — from the console alone. Screenshots at a desktop's and a phone's size."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from playwright.async_api import Browser, Page, expect

from server.settings import Settings
from tests.hubtools import HubUnderTest, free_port, hub_in_process
from tests.test_console import KEY, MARKUP, _story
from tests.webtools import (
    DESKTOP,
    PHONE,
    contrast,
    focus_ring,
    open_page,
    overflow,
    page_errors,
    shoot,
    tab_to,
    unnamed_controls,
)


@pytest.fixture
async def ops(hub_settings: Settings) -> AsyncIterator[tuple[HubUnderTest, str]]:
    port = free_port()
    settings = hub_settings.replace(metrics_port=port, console_key=KEY, dev_login=False, demo_topup=False)
    async with hub_in_process(settings) as h:
        yield h, f"http://127.0.0.1:{port}"


async def _looks_right(page: Page) -> None:
    assert await unnamed_controls(page) == []
    assert await contrast(page) == []
    assert await overflow(page) == []
    assert page_errors(page) == []


async def _sign_in_by_keyboard(page: Page) -> None:
    await expect(page.locator("#key")).to_be_focused()
    await page.keyboard.type("not the key")
    await page.keyboard.press("Enter")
    await expect(page.locator("#sign-in-error")).to_have_text("that is not the console key")
    await page.locator("#key").fill("")
    await page.keyboard.type(KEY)
    await page.keyboard.press("Enter")
    await expect(page.locator("#session")).to_contain_text("Signed in until")
    await expect(page.locator("#packet-id")).to_be_focused()


@pytest.mark.parametrize("size", ["desktop", "phone"])
async def test_support_answers_where_the_money_is_and_whether_it_was_fair(
    browser: Browser, ops: tuple[HubUnderTest, str], size: str
) -> None:
    h, base = ops
    s = await _story(h.core)
    w, fin, old = s["w"], s["fin"], s["old"]
    page = await open_page(browser, f"{base}/console/", DESKTOP if size == "desktop" else PHONE)
    await _looks_right(page)
    await _sign_in_by_keyboard(page)
    await expect(page.locator("#now-connections")).not_to_have_text("–")  # the live figures drawn

    # "Was it fair?", and where each grabber's money is: the finished packet, by keyboard.
    await page.keyboard.type(str(fin.packet_id))
    await page.keyboard.press("Enter")
    view = page.locator("#view")
    await expect(view.locator("h2")).to_have_text(f"Packet {fin.packet_id}")
    await expect(view).to_contain_text("恭喜发财")
    await expect(view.locator(".verdict")).to_contain_text("verified")
    rows = view.get_by_role("table", name="Grabs in order").locator("tbody tr")
    await expect(rows).to_have_count(3)
    for i, credit in enumerate(("paid", "waiting for a worker", "refused share_conflict")):  # in grab order
        await expect(rows.nth(i).locator("td").nth(1)).to_have_text(str(w.members[i]))
        for word in credit.split(" ", 1 if credit.startswith("refused") else 0)[:2]:
            await expect(rows.nth(i)).to_contain_text(word)
    await _looks_right(page)
    await shoot(page, f"console-{size}-packet")

    # The sender of the packet that expired: its refund, on the packet and in the sender's journal.
    await page.locator("#packet-id").fill(str(old.packet_id))
    await page.locator("#packet-id").press("Enter")
    refund = s["refund"]
    await expect(view.locator("h2")).to_have_text(f"Packet {old.packet_id}")
    await expect(view).to_contain_text("refunded")
    await expect(view).to_contain_text(MARKUP)  # its greeting shown as the text it is
    await expect(view.locator("img, b")).to_have_count(0)
    assert await page.evaluate("window.__owned") is None
    amount = 300 - s["early"].grab.amount
    await expect(view).to_contain_text(f"¥{amount // 100}.{amount % 100:02d} at")
    assert refund is not None
    await tab_to(page, "#user-id")
    ring = await focus_ring(page)
    assert ring["focusVisible"] and ring["style"] != "none", ring
    await page.keyboard.type(str(w.admin))
    await page.keyboard.press("Enter")
    await expect(view.locator("h2")).to_have_text(f"User {w.admin} · admin")
    await expect(view).to_contain_text("matches the balance")
    journal = view.get_by_role("table", name="Journal rows with the balance after each").locator("tbody tr")
    await expect(journal.first).to_contain_text("refund")
    await _looks_right(page)
    await shoot(page, f"console-{size}-user")

    # The books: the outbox waiting, this hub among those seen.
    await tab_to(page, "#books")
    await page.keyboard.press("Enter")
    await expect(view.locator("h2")).to_have_text("The books")
    await expect(view).to_contain_text("3 in the 64 shard outboxes; the oldest waiting")
    await _looks_right(page)
    await shoot(page, f"console-{size}-books")
