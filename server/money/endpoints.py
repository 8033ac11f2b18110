"""The webhook endpoints: where events go, each URL with its secret (and the previous one while it rolls)
and the event types it takes — and how a URL is named anywhere it is shown.

Two settings give them. ``REDPACKET_WEBHOOK_URLS`` lists URLs that take every event, signed with
``REDPACKET_WEBHOOK_SECRET`` (and ``_PREVIOUS``): the defaults. ``REDPACKET_WEBHOOK_ENDPOINTS`` is a JSON
list (the text itself, or a file holding it, as ``REDPACKET_JWT_PUBLIC_KEY`` is PEM text or a file) of
``{"url", "secret", "secret_previous", "events"}`` objects: each URL its own secret (``secret`` left out:
the defaults, both of them), its own roll, and the event types it is sent (left out: every type). An
unknown key, an unknown event type, a URL named twice, a secret shorter than 32 characters: refused at
start-up (``configured``, which ``redpacket`` runs before any command).

**A URL's secrets are never shown** (a log line, an error, the CLI, the service API): ``label`` is the one
way to print a URL (host, port and path: no ``user:password@``, no query), and ``scrub`` takes a URL's
secrets out of a text that may quote it (an httpx error).
"""

from __future__ import annotations

import difflib
import functools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qsl, quote, unquote, urlsplit

from server.money import deliveries, events
from server.settingfields import env_name
from server.settings import Settings, sealed

NAME = env_name("webhook_endpoints")
KEYS = ("url", "secret", "secret_previous", "events")
MIN_SECRET = 32


# A path segment this long may be a token: Slack's and Discord's webhook URLs carry theirs in the path
# (``/services/T0…/B0…/<24 characters>``, ``/api/webhooks/<id>/<68 characters>``). Shown as ``***`` —
# unless it is all digits (Discord's id): two endpoints must not share one label in the metrics.
SECRET_SEGMENT = 16


def _secret(segment: str) -> bool:
    return len(segment) >= SECRET_SEGMENT and not (segment.isascii() and segment.isdigit())


def _secret_segments(path: str) -> list[str]:
    return [seg for seg in path.split("/") if _secret(seg)]


def label(url: str) -> str:
    """A URL as it is shown (metrics, logs, the CLI, the service API): host, port and path — never its
    ``user:password@``, its query or a path segment of ``SECRET_SEGMENT`` characters or more, any of
    which may hold a token."""
    u = urlsplit(url)
    try:
        port = u.port
    except ValueError:  # (a port that is no number: shown without one)
        port = None
    path = "/".join("***" if _secret(seg) else seg for seg in u.path.split("/"))
    return f"{u.hostname or ''}{f':{port}' if port else ''}{path or '/'}"


def _encoded(text: str) -> str:
    """``text`` with every character but letters and digits percent-encoded (a spelling some encode)."""
    return "".join(
        c if c.isascii() and c.isalnum() else "".join(f"%{b:02X}" for b in c.encode()) for c in text
    )


# What stands for a secret in a text: a URL's ``user:password@`` and query, whoever's URL it quotes.
_USERINFO = re.compile(r"(?<=//)[^/@\s\"'<>]+@")
_QUERY = re.compile(r"\?[^\s\"'<>#]+")
# A secret of the URL is also replaced wherever it appears alone, if it is at least this long (a short one
# would hit other text: "1" in every address).
_ALONE = 8


def scrub(text: str, url: str) -> str:
    """``text`` (an error's, a log line's) with none of ``url``'s secrets: the URL itself shown as its
    ``label``; any URL's ``user:password@`` and query, in whatever spelling a library quotes them; and
    ``url``'s user, password, query values and long path segments where they appear alone, raw, decoded
    or re-encoded."""
    text = _QUERY.sub("?***", _USERINFO.sub("***@", text.replace(url, label(url))))
    u = urlsplit(url)
    raw = {u.username or "", u.password or ""} | {kv.partition("=")[2] for kv in u.query.split("&")}
    raw |= set(_secret_segments(u.path))
    parts = raw | {v for _, v in parse_qsl(u.query, keep_blank_values=True)} | {unquote(p) for p in raw}
    parts |= {quote(p, safe="") for p in parts} | {_encoded(p) for p in parts}
    parts |= {re.sub(r"%[0-9A-F]{2}", lambda m: m.group(0).lower(), p) for p in parts}  # (%2d as %2D)
    for part in sorted((p for p in parts if len(p) >= _ALONE), key=len, reverse=True):
        text = text.replace(part, "***")
    return text


@dataclass(frozen=True)
class Endpoint:
    """One URL the worker POSTs events to. ``events``: the types it is sent, None for every one."""

    url: str = field(repr=False)
    secret: str = field(repr=False)
    secret_previous: str = field(default="", repr=False)
    events: tuple[str, ...] | None = None

    @property
    def id(self) -> str:
        """Its key in the deliveries' queue and in the service API (a hash of the URL)."""
        return deliveries.endpoint_id(self.url)

    @property
    def label(self) -> str:
        return label(self.url)

    def view(self) -> dict[str, object]:
        """What the service API shows of it: never a secret, nor the URL's."""
        return {
            "id": self.id,
            "url": self.label,
            "events": None if self.events is None else list(self.events),
        }


def configured(settings: Settings) -> tuple[Endpoint, ...]:
    """Every webhook endpoint, in order: ``REDPACKET_WEBHOOK_URLS``' then ``REDPACKET_WEBHOOK_ENDPOINTS``'.
    ``ValueError`` (one line, no secret in it) for one that cannot be used. Read once per process."""
    return _configured(
        settings.webhook_url_list,
        settings.webhook_secret,
        settings.webhook_secret_previous,
        settings.webhook_endpoints,
    )


@functools.cache
def _configured(urls: tuple[str, ...], secret: str, previous: str, listed: str) -> tuple[Endpoint, ...]:
    found = [Endpoint(u, secret, previous) for u in urls]
    found += [_endpoint(item, n, secret, previous) for n, item in enumerate(_entries(listed), start=1)]
    seen: set[str] = set()
    for e in found:
        if e.url in seen:
            raise ValueError(
                f"{NAME}: {e.label} is named twice (in it, or in it and REDPACKET_WEBHOOK_URLS): one entry"
                " per URL"
            )
        seen.add(e.url)
    return tuple(found)


def _entries(listed: str) -> list[object]:
    if not listed.strip():
        return []
    text = listed
    if not listed.lstrip().startswith(("[", "{", '"')):  # (JSON, however wrong: never taken for a path)
        try:
            text = Path(listed).read_text()
        except OSError as e:
            # (The value is not shown: a list written wrong holds secrets.)
            raise ValueError(
                f"{NAME} is neither a JSON list nor the path of a readable file ({e.strerror})"
            ) from None
    try:
        items = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{NAME} does not hold JSON: {e}") from None
    if not isinstance(items, list):
        raise ValueError(f'{NAME} holds a JSON list of {{"url": …, "secret": …}} objects')
    return items


def _endpoint(item: object, n: int, default: str, default_previous: str) -> Endpoint:
    where = f"{NAME}, entry {n}"
    if not isinstance(item, dict):
        raise ValueError(f"{where}: an object with {', '.join(KEYS)} (got {type(item).__name__})")
    unknown = sorted(set(item) - set(KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r} (the keys: {', '.join(KEYS)})")
    url = item.get("url")
    if not isinstance(url, str) or not url:
        raise ValueError(f"{where}: needs a url, a string")
    where = f"{where} ({label(url)})"
    u = urlsplit(url)
    if not u.hostname or not sealed(url):
        raise ValueError(
            f"{where}: an https:// URL (plain http only to this machine): the events carry who was paid what"
        )
    secret, previous = item.get("secret"), item.get("secret_previous")
    for key, value in (("secret", secret), ("secret_previous", previous)):
        if value is not None and (not isinstance(value, str) or len(value) < MIN_SECRET):
            raise ValueError(f"{where}: {key} is at least {MIN_SECRET} characters (`openssl rand -hex 32`)")
    if previous is not None and (secret is None or previous == secret):
        raise ValueError(f"{where}: secret_previous is the secret being rolled out, beside a new secret")
    if secret is None and len(default) < MIN_SECRET:
        raise ValueError(f"{where}: no secret, and no REDPACKET_WEBHOOK_SECRET to default to")
    return Endpoint(
        url,
        default if secret is None else str(secret),
        default_previous if secret is None else str(previous or ""),
        _types(item.get("events"), where),
    )


def _types(value: object, where: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not value or not all(isinstance(t, str) for t in value):
        raise ValueError(f"{where}: events is a list of event types, or left out for every type")
    for t in value:
        if t not in events.TYPES:
            close = difflib.get_close_matches(t, events.TYPES, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ValueError(f"{where}: {t!r} is no event type{hint}; the types: {', '.join(events.TYPES)}")
    return tuple(dict.fromkeys(value))
