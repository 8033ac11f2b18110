"""Webhook endpoints of their own (``REDPACKET_WEBHOOK_ENDPOINTS``) as the settings read them: the guide's
file taken as written, each URL with its own secret or the defaults, and every bad entry refused saying which,
never quoting a secret."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from server.money.endpoints import configured
from server.settings import Settings
from tests.repofiles import GUIDE
from tests.webhooktools import OTHER, OWN, SECRET


def listed(*entries: dict[str, Any], **settings: Any) -> Settings:
    return Settings(webhook_endpoints=json.dumps(list(entries)), **settings)


def test_the_guides_endpoints_file_is_taken_as_written(tmp_path: Path) -> None:
    m = re.search(r"<!-- webhook-endpoints -->\n```json\n(.*?)```", GUIDE.read_text(), re.DOTALL)
    assert m
    (tmp_path / "endpoints.json").write_text(m[1])
    found = configured(Settings(webhook_endpoints=str(tmp_path / "endpoints.json")))
    assert [e.label for e in found] == [
        "wallet.example.com/hooks/redpacket",
        "chat.example.com/hooks/packets",
    ]
    assert found[0].events is not None and "share.credited" not in found[0].events
    assert found[1].secret_previous and not found[0].secret_previous


def test_each_url_has_its_secret_or_the_defaults() -> None:
    s = listed(
        {"url": "https://a.example/h", "secret": OWN, "secret_previous": OTHER},
        {"url": "https://b.example/h", "events": ["account.topup"]},
        webhook_urls="https://c.example/h",
        webhook_secret=SECRET,
        webhook_secret_previous=OTHER,
    )
    c, a, b = configured(s)
    assert (c.url, c.secret, c.secret_previous, c.events) == ("https://c.example/h", SECRET, OTHER, None)
    assert (a.secret, a.secret_previous, a.events) == (OWN, OTHER, None)
    assert (b.secret, b.secret_previous, b.events) == (SECRET, OTHER, ("account.topup",))
    assert OWN not in repr(a) and SECRET not in repr(b)  # (a traceback's locals, a debug print)


@pytest.mark.parametrize(
    ("entries", "words"),
    [
        ([{"url": "https://a.example/h", "secret": OWN, "event": ["account.topup"]}], "unknown key 'event'"),
        ([{"url": "https://a.example/h", "secret": OWN, "events": ["share.credit"]}], "share.credited?"),
        ([{"url": "https://a.example/h", "secret": OWN, "events": []}], "events is a list"),
        ([{"url": "https://a.example/h", "secret_previous": OWN}], "secret_previous"),
        ([{"url": "https://a.example/h", "secret": OWN, "secret_previous": OWN}], "secret_previous"),
        ([{"url": "https://a.example/h", "secret": "short"}], "at least 32"),
        ([{"url": "https://a.example/h"}], "no secret"),
        ([{"url": "http://a.example/h?token=tok-1234", "secret": OWN}], "https://"),
        ([{"url": "https://a.example/h", "secret": OWN}] * 2, "named twice"),
        ([{"secret": OWN}], "needs a url"),
        (["https://a.example/h"], "an object"),
        # One object, not a list: before, taken for a file's path and quoted whole, secrets and all.
        ({"url": "https://a.example/h?token=tok-1234", "secret": OWN}, "a JSON list of"),
    ],
)
def test_a_bad_entry_is_refused_saying_which_and_no_secret(entries: Any, words: str) -> None:
    with pytest.raises(ValueError, match=re.escape(words)) as caught:
        configured(Settings(webhook_endpoints=json.dumps(entries)))
    said = str(caught.value)
    assert said.startswith("REDPACKET_WEBHOOK_ENDPOINTS") and "\n" not in said
    assert OWN not in said and "tok-1234" not in said and "short" not in said.replace("shorter", "")
