"""The README as a newcomer follows it: the shell lines and the Python script of "Try it", run as written
against a real ``redpacket up``, and exactly two commands for a newcomer."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import shutil
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest

from server.core import Core
from server.live.bots import list_blocks, now_ms, run_detector
from server.live.botscore import Attempt, Rules, score
from server.money import groups
from server.settings import Settings
from server.store import keys
from tests.hubtools import hub_in_process, redpacket_up

README = Path(__file__).resolve().parent.parent / "README.md"


def block(marker: str) -> str:
    """The fenced code between ``<!-- marker -->`` and ``<!-- /marker -->``."""
    m = re.search(rf"<!-- {marker} -->\n```\w*\n(.*?)```\n<!-- /{marker} -->", README.read_text(), re.DOTALL)
    assert m, f"no {marker} block in the README"
    return m[1]


@pytest.mark.skipif(shutil.which("curl") is None, reason="the README's HTTP lines use curl")
def test_try_it_runs_as_written(tmp_path: Path) -> None:
    with redpacket_up(tmp_path / "data") as (url, _):
        address = url.removeprefix("http://")
        shell = block("try-shell").replace("127.0.0.1:8000", address)
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", shell],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert '"added":1' in done.stdout.replace(" ", ""), done.stdout
        # Each reply printed on a line of its own (curl adds no newline: -w '\n').
        assert [line[:1] for line in done.stdout.splitlines()] == ["{"] * 4, done.stdout
        script = tmp_path / "try.py"
        script.write_text(block("try-python").replace("127.0.0.1:8000", address))
        ran = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
        assert ran.returncode == 0, ran.stdout + ran.stderr
        m = re.fullmatch(r"li grabbed (\d+) of 888 cents; 1 share left\n", ran.stdout)
        assert m and 1 <= int(m[1]) <= 887, ran.stdout


async def test_the_python_example_runs_again_and_again_and_is_never_taken_for_a_bot(
    hub_settings: Settings,
) -> None:
    """Before: each run of the README's script was throttled (`1 grab(s) faster than 100 ms`) and the
    fourth within a minute blocked li for an hour. Four runs, then the detector over them: no decision."""
    async with hub_in_process(hub_settings) as h:
        script = block("try-python").replace("127.0.0.1:8000", h.http.removeprefix("http://"))
        # Run before the curl lines made the group: one line, no traceback.
        early = await asyncio.create_subprocess_exec(
            sys.executable, "-c", script, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        out, err = await asyncio.wait_for(early.communicate(), 120)
        assert early.returncode == 1 and err.decode().splitlines() == [
            "try.py: wang has no group named family: run the curl lines above first"
        ], err
        wang, _ = await h.login("wang")
        li, _ = await h.login("li")
        family = await groups.create_group(h.core.db, wang, "family")
        await groups.add_members(h.core.db, h.core.membership, family, [li])
        # No money but what each run tops up itself: it runs however often a reader runs it.
        for _ in range(4):
            run = await asyncio.create_subprocess_exec(
                sys.executable, "-c", script, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
            )
            out, _ = await asyncio.wait_for(run.communicate(), 120)
            assert run.returncode == 0 and out.startswith(b"li grabbed "), out
        decisions = await run_detector(h.core, now=now_ms())
        assert decisions == {}, decisions
        assert li not in {b.user for b in await list_blocks(h.core)}


async def test_a_backends_scripted_clients_can_be_exempted(core: Core) -> None:
    """What the detector does to a script grabbing at once, and REDPACKET_BOT_EXEMPT_USERS, as the worker
    reads it, letting the backend's own through."""
    now = now_ms()
    fast = [[7, 1, packet, 5, "", now] for packet in range(3)]  # three grabs 5 ms after the packet showed
    await core.redis.xadd(keys.grab_attempts(), {"a": msgpack.packb(fast)})
    exempt = core.settings.replace(bot_exempt_users="7, 8")
    exempt.check()
    assert await run_detector(dataclasses.replace(core, settings=exempt), now=now) == {}
    assert (await run_detector(core, now=now))[7].action == "block"
    assert (
        score(
            [Attempt(user=7, group=1, packet=1, reaction_ms=5, device="", ms=now)] * 3,
            Rules(exempt=exempt.bot_exempt_user_ids),
            now,
        )
        == {}
    )
    with pytest.raises(ValueError, match="BOT_EXEMPT_USERS"):
        core.settings.replace(bot_exempt_users="seven").check()
