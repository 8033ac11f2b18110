"""What the browser tests look at on a page, beyond clicking: things that overflow the viewport, text
whose contrast is below WCAG AA, controls without an accessible name, focus that cannot be seen (these in
``pagechecks.js``), and which font really drew a greeting. Each returns what it found wrong (empty when
all is well) so that a test's failure names the element."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from playwright.async_api import Browser, Page

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
PHONE = {"width": 390, "height": 844}
DESKTOP = {"width": 1280, "height": 800}
WAIT_MS = 15_000

# Holds the page's grab requests until the test releases them: the 開 coin's in-flight state is then
# on screen for as long as the test needs to look at it, however fast or slow the machine is.
HOLD_GRABS = """
(() => {
  const send = WebSocket.prototype.send;
  window.__held = [];
  window.__hold = false;
  WebSocket.prototype.send = function (data) {
    if (window.__hold && typeof data === "string" && JSON.parse(data).type === "grab") {
      window.__held.push([this, data]);
      return;
    }
    return send.call(this, data);
  };
  window.__release = () => {
    window.__hold = false;
    for (const [ws, data] of window.__held.splice(0)) send.call(ws, data);
  };
})();
"""

# The checks themselves run in the page: tests/pagechecks.js.
PAGE_CHECKS = (Path(__file__).parent / "pagechecks.js").read_text()


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
REQUIRED = os.environ.get("REDPACKET_TEST_REQUIRE_BROWSER") == "1"


def cjk_font_installed() -> bool:
    found = subprocess.run(["fc-list", ":lang=zh", "family"], capture_output=True, text=True, check=False)
    return bool(found.stdout.strip())


async def open_page(browser: Browser, url: str, viewport: dict[str, int], hold_grabs: bool = False) -> Page:
    context = await browser.new_context(viewport=viewport)  # type: ignore[arg-type]
    context.set_default_timeout(WAIT_MS)
    page = await context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    # Anything the hub's Content-Security-Policy stopped is an error of the page too.
    page.on("console", lambda m: errors.append(m.text) if "Content Security Policy" in m.text else None)
    page.errors = errors  # type: ignore[attr-defined]
    if hold_grabs:
        await page.add_init_script(HOLD_GRABS)
    await page.goto(url)
    return page


def page_errors(page: Page) -> list[str]:
    return list(page.errors)  # type: ignore[attr-defined]


async def overflow(page: Page) -> list[str]:
    return list(await page.evaluate(PAGE_CHECKS, "overflow"))


async def contrast(page: Page) -> list[str]:
    """Every visible text on the page below WCAG AA contrast; fails if there was nothing to measure."""
    found: dict[str, Any] = await page.evaluate(PAGE_CHECKS, "contrast")
    assert found["checked"] > 0, "no text to measure"
    return list(found["failures"])


async def unnamed_controls(page: Page) -> list[str]:
    return list(await page.evaluate(PAGE_CHECKS, "unnamed"))


async def focus_ring(page: Page) -> dict[str, Any]:
    return dict(await page.evaluate(PAGE_CHECKS, "focusRing"))


async def fonts_of(page: Page, selector: str) -> list[str]:
    """The font families Chromium really drew ``selector``'s text with (not what the CSS asked for)."""
    cdp = await page.context.new_cdp_session(page)
    await cdp.send("DOM.enable")
    await cdp.send("CSS.enable")
    root = await cdp.send("DOM.getDocument")
    node = await cdp.send("DOM.querySelector", {"nodeId": root["root"]["nodeId"], "selector": selector})
    used = await cdp.send("CSS.getPlatformFontsForNode", {"nodeId": node["nodeId"]})
    await cdp.detach()
    return [f["familyName"] for f in used["fonts"]]


# Resolves when every animation with an end (the amount's pop, the balance's bump) has ended.
ANIMATIONS_ENDED = """() => Promise.all(document.getAnimations()
  .filter((a) => a.effect.getComputedTiming().endTime !== Infinity)
  .map((a) => a.finished.catch(() => null)))"""


async def shoot(page: Page, name: str) -> None:
    """A screenshot of the page as it settles (not halfway through an animation)."""
    await page.evaluate(ANIMATIONS_ENDED)
    ARTIFACTS.mkdir(exist_ok=True)
    await page.screenshot(path=str(ARTIFACTS / f"{name}.png"))


async def tab_to(page: Page, selector: str, most: int = 80) -> None:
    """Press Tab until ``selector`` has the focus: it is reachable by keyboard (or fail after ``most``)."""
    for _ in range(most):
        await page.keyboard.press("Tab")
        if await page.evaluate("(s) => document.activeElement.matches(s)", selector):
            return
    raise AssertionError(f"{selector} is not reached by Tab in {most} presses")
