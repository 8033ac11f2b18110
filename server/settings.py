"""The one settings object, built from the environment once at start-up and passed down.

Nothing else in the project reads ``os.environ``. Each setting is declared once, in
``server.settingfields`` (name, type, default, bounds, help); ``from_env`` and the bound checks are read
from those declarations.
"""

from __future__ import annotations

import difflib
import ipaddress
import math
import os
import re
from collections.abc import Mapping
from dataclasses import Field, dataclass, fields, replace
from functools import cached_property
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from server.durability import DURABILITY, Durability
from server.settingfields import PREFIX, SettingFields, env_name

REDIS_SCHEMES = ("redis://", "rediss://", "unix://", "redis+cluster://")
DATABASE_SCHEMES = ("mysql://", "mariadb://", "sqlite:///")
# REDPACKET_REDIS_URL's name for the data directory's own Valkey (what an empty URL means under `up`).
EMBEDDED = "embedded"
# REDPACKET_ names that are not settings, and so not refused: what `redpacket load` tells its Locust
# processes, and the test suite's own (REDPACKET_TEST_REDIS_URL, …).
NOT_SETTINGS = ("REDPACKET_LOAD_STAGES", "REDPACKET_TEST_")


def _number(name: str, raw: str, kind: type[int] | type[float]) -> int | float:
    try:
        return kind(raw)
    except ValueError as e:
        what = "n integer" if kind is int else " number"
        raise ValueError(f"{env_name(name)} must be a{what}, got {raw!r}") from e


def _parse(f: Field[Any], raw: str) -> object | None:
    """A setting's value from its environment variable's text, or None for its default: an empty number
    or flag is its default; flags are numbers, 0 off; text is taken as it is (empty included)."""
    kind = type(f.default)
    if kind in (bool, int, float):
        if raw == "":
            return None
        if kind is bool:
            return bool(_number(f.name, raw, int))
        return _number(f.name, raw, float if kind is float else int)
    return Path(raw) if isinstance(f.default, Path) else raw


def is_loopback(host: str) -> bool:
    """Whether a hub listening on ``host`` is reachable from this machine alone."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def sealed(url: str) -> bool:
    """Whether what goes to ``url`` cannot be read or changed on the way: ``https://``, or plain
    ``http://`` to this machine."""
    u = urlparse(url)
    return u.scheme == "https" or (u.scheme == "http" and is_loopback(u.hostname or ""))


def redact(url: str) -> str:
    """A URL fit to print: its password replaced by ``***``."""
    return re.sub(r"(://[^:/@]*:)[^@/]*@", r"\1***@", url)


def _refuse_unknown(env: Mapping[str, str], names: set[str]) -> None:
    unknown = sorted(
        k for k in env if k.startswith(PREFIX) and k not in names and not k.startswith(NOT_SETTINGS)
    )
    if not unknown:
        return
    first = unknown[0]
    bare = [n.removeprefix(PREFIX) for n in names]  # (the shared prefix would make every name look close)
    close = difflib.get_close_matches(first.removeprefix(PREFIX), bare, n=1, cutoff=0.75)
    hint = f" (did you mean {PREFIX}{close[0]}?)" if close else ""
    more = f"; so are {', '.join(unknown[1:])}" if len(unknown) > 1 else ""
    raise ValueError(
        f"{first} is not a setting{hint}{more}: fix or unset it (every setting is in docs/configuration.md)"
    )


def child_env(**values: str) -> dict[str, str]:
    """The environment for a child process (a hub, a worker): this one's, without any REDPACKET_
    setting of its own, plus ``values`` (e.g. ``REDPACKET_REDIS_URL=...``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(PREFIX)}
    env.update(values)
    return env


def url_problem(url: str) -> str:
    """What is wrong with the shape of a Redis or database URL (a port that is not a number, a broken
    IPv6 address, a Redis database that is not a number, no host), or "" when nothing is (or it is
    empty). Whether anything answers there is for start-up to find."""
    if not url or url == EMBEDDED or url.startswith(("unix://", "sqlite://")):
        return ""
    scheme, _, rest = url.partition("://")
    hosts, _, path = rest.partition("/")
    if "@" in hosts:
        hosts = hosts.rsplit("@", 1)[1]
    several = scheme in ("redis+cluster", "mysql", "mariadb")
    for host in hosts.split(",") if several else [hosts]:
        try:
            parsed = urlparse(f"x://{host}")
            parsed.port  # noqa: B018 - raises on a port that is not a number
        except ValueError as e:
            return f"has a host that cannot be read ({host!r}: {e})"
        if not parsed.hostname:
            return f"names no host ({host!r})"
    database = path.split("?", 1)[0]
    if scheme in ("redis", "rediss") and database and not database.isdigit():
        return f"ends in a Redis database that is not a number ({database!r})"
    if scheme in ("mysql", "mariadb") and not database:
        return f"names no database: {scheme}://user:password@host:port/DATABASE"
    return ""


@dataclass(frozen=True)
class Settings(SettingFields):
    """Every tunable of the system (declared in ``SettingFields``; see docs/configuration.md),
    read from the environment once, with what they mean derived and checked."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """The settings the environment gives; ``ValueError`` for a REDPACKET_ name that is no setting (a
        misspelt one would leave its setting at its default: the demo's storage, every origin)."""
        env = os.environ if environ is None else environ
        _refuse_unknown(env, {env_name(f.name) for f in fields(cls)})
        if "FORWARDED_ALLOW_IPS" in env:  # (uvicorn's own, which the hub would silently not read)
            raise ValueError(
                f"FORWARDED_ALLOW_IPS is not read by the hub: name the proxies in {PREFIX}TRUSTED_PROXIES"
            )
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(env_name(f.name))
            value = None if raw is None else _parse(f, raw)
            if value is not None:
                values[f.name] = value
        return cls(**values)

    @cached_property
    def durability(self) -> Durability:
        """``grab_durability``; unset, ``aof`` on the embedded Valkey (no Redis URL) and ``none`` on any
        other Redis. ``replace`` keeps it across a change of ``redis_url``."""
        if self.grab_durability:
            return Durability(self.grab_durability)
        return Durability.AOF if self.embedded_redis else Durability.NONE

    @property
    def backend(self) -> bool:
        """Whether a chat backend is configured: its service key, or its tokens' public key or JWKS."""
        return bool(self.service_key or self.jwt_public_key or self.jwks_url)

    @property
    def users_manage_groups(self) -> bool:
        """Whether users may create groups and change members (``REDPACKET_USER_GROUPS``)."""
        return self.user_groups == "1" if self.user_groups else not self.service_key

    @property
    def allowed_origin_list(self) -> tuple[str, ...]:
        """``REDPACKET_ALLOWED_ORIGINS``, each lower-cased without a trailing slash."""
        return tuple(o.strip().lower().rstrip("/") for o in self.allowed_origins.split(",") if o.strip())

    @property
    def trusted_proxy_list(self) -> tuple[str, ...]:
        """``REDPACKET_TRUSTED_PROXIES``: each address or network as written."""
        return tuple(p.strip() for p in self.trusted_proxies.split(",") if p.strip())

    @property
    def bot_exempt_user_ids(self) -> frozenset[int]:
        """``REDPACKET_BOT_EXEMPT_USERS``: comma-separated user ids."""
        return frozenset(int(u) for u in self.bot_exempt_users.replace(" ", "").split(",") if u)

    @property
    def webhook_url_list(self) -> tuple[str, ...]:
        """``webhook_urls``, split at commas (each URL once, in the order given)."""
        return tuple(dict.fromkeys(u.strip() for u in self.webhook_urls.split(",") if u.strip()))

    @property
    def jwt_algorithm_list(self) -> tuple[str, ...]:
        """The token algorithms this hub takes: HS256, or RS256/ES256 with a public key or a JWKS."""
        if self.jwt_algorithms:
            return tuple(a.strip() for a in self.jwt_algorithms.split(",") if a.strip())
        return ("RS256", "ES256") if self.jwt_public_key or self.jwks_url else ("HS256",)

    def jwt_public_key_pem(self) -> str:
        """REDPACKET_JWT_PUBLIC_KEY as PEM text: the value itself, or the file it names."""
        key = self.jwt_public_key.strip()
        if not key or key.startswith("-----BEGIN"):
            return key
        try:
            return Path(key).read_text()
        except OSError as e:
            raise ValueError(
                f"{PREFIX}JWT_PUBLIC_KEY is neither PEM text nor a readable file: {key} ({e.strerror})"
            ) from None

    def check(self) -> None:
        """Raise ``ValueError`` (one line: what is wrong, what to do) for a setting no run can use: numbers
        against their declared bounds, the rest one concern at a time."""
        self._check_tokens()
        self._check_urls()
        self._check_numbers()
        self._check_switches()
        self._check_lists()

    def _check_tokens(self) -> None:
        """The token algorithms and the keys that check them."""
        algorithms = self.jwt_algorithm_list
        if not algorithms or not (set(algorithms) <= {"HS256"} or set(algorithms) <= {"RS256", "ES256"}):
            raise ValueError(
                f"{PREFIX}JWT_ALGORITHMS is HS256, or any of RS256 and ES256, never both kinds"
                f" (got {self.jwt_algorithms!r})"
            )
        if "HS256" in algorithms and (self.jwt_public_key or self.jwks_url):
            raise ValueError(
                f"{PREFIX}JWT_PUBLIC_KEY and {PREFIX}JWKS_URL are for RS256/ES256: leave"
                f" {PREFIX}JWT_ALGORITHMS empty or name those"
            )
        if "HS256" not in algorithms and bool(self.jwt_public_key) == bool(self.jwks_url):
            raise ValueError(
                f"RS256/ES256 tokens need one of {PREFIX}JWT_PUBLIC_KEY (PEM text or a file) and"
                f" {PREFIX}JWKS_URL"
            )
        if "HS256" in algorithms and self.secret and len(self.secret.encode()) < 32:
            raise ValueError(
                f"{PREFIX}SECRET is too short for HS256: at least 32 characters (RFC 7518), e.g."
                " `openssl rand -hex 32`"
            )
        pem = self.jwt_public_key_pem()
        if pem:
            from cryptography.hazmat.primitives.serialization import load_pem_public_key

            try:
                load_pem_public_key(pem.encode())
            except (ValueError, TypeError) as e:
                raise ValueError(
                    f"{PREFIX}JWT_PUBLIC_KEY does not hold a PEM public key (-----BEGIN PUBLIC KEY-----): {e}"
                ) from None
        if self.jwks_url:
            if not sealed(self.jwks_url):
                raise ValueError(
                    f"{PREFIX}JWKS_URL must be https (plain http only to this machine): the keys that say"
                    f" who every user is must not be swappable on the way (got {self.jwks_url!r})"
                )
        if self.hook_url:
            u = urlparse(self.hook_url)
            if not u.hostname or not sealed(self.hook_url):
                raise ValueError(
                    f"{PREFIX}HOOK_URL: an https:// URL (plain http only to this machine): it is told who"
                    f" pays what and decides it (got {u.scheme}://{u.hostname or ''}…)"
                )
            if len(self.hook_secret) < 32:
                raise ValueError(
                    f"{PREFIX}HOOK_SECRET is required with a hook URL, at least 32 characters, e.g."
                    " `openssl rand -hex 32`: the backend checks every call's signature with it"
                )
        for url in self.webhook_url_list:
            u = urlparse(url)
            if not u.hostname or not sealed(url):
                raise ValueError(
                    f"{PREFIX}WEBHOOK_URLS: each is an https:// URL (plain http only to this machine): the"
                    f" events carry who was paid what (got {u.scheme}://{u.hostname or ''}…)"
                )
        if self.webhook_url_list and len(self.webhook_secret) < 32:
            raise ValueError(
                f"{PREFIX}WEBHOOK_SECRET is required with webhook URLs, at least 32 characters, e.g."
                " `openssl rand -hex 32`: receivers check every delivery's signature with it"
            )
        if self.service_key and len(self.service_key) < 32:
            raise ValueError(
                f"{PREFIX}SERVICE_KEY is too short: at least 32 characters, e.g. `openssl rand -hex 32`"
            )
        key, where = self.console_key, self.metrics_port or self.console_on_hub_port
        if key and (len(key) < 32 or key in (self.service_key, self.secret) or not where):
            raise ValueError(
                f"{PREFIX}CONSOLE_KEY is the operators' own, at least 32 characters (`openssl rand -hex 32`),"
                f" not the service key or the secret; the console is served beside {PREFIX}METRICS_PORT (set"
                f" it), or with {PREFIX}CONSOLE_ON_HUB_PORT=1 on the hub's public port"
            )
        for name, current, previous in (
            ("SERVICE_KEY", self.service_key, self.service_key_previous),
            ("WEBHOOK_SECRET", self.webhook_secret, self.webhook_secret_previous),
        ):
            if previous and (not current or previous == current or len(previous) < 32):
                raise ValueError(
                    f"{PREFIX}{name}_PREVIOUS is the {name.lower().replace('_', ' ')} being rolled out:"
                    f" at least 32 characters, beside a new {PREFIX}{name} that is not the same"
                )

    def _check_urls(self) -> None:
        """The Redis and database URLs: their schemes and shapes, the queue's server, the durability."""
        if self.redis_url and not self.embedded_redis and not self.redis_url.startswith(REDIS_SCHEMES):
            raise ValueError(
                f"{PREFIX}REDIS_URL must start with {', '.join(REDIS_SCHEMES)}"
                f" (got {redact(self.redis_url)!r}), or be {EMBEDDED!r} for the data directory's own Valkey"
            )
        if self.database_url and not self.database_url.startswith(DATABASE_SCHEMES):
            raise ValueError(
                f"{PREFIX}DATABASE_URL must start with {', '.join(DATABASE_SCHEMES)}"
                f" (got {redact(self.database_url)!r}); leave it empty for SQLite in the data directory"
            )
        for url in self.shard_urls:
            if not url.startswith(DATABASE_SCHEMES[:2]) or url_problem(url) or "," in url.partition("@")[2]:
                raise ValueError(
                    f"{PREFIX}SHARDS must list MySQL URLs of one server each, separated by commas"
                    f" (got {redact(url)!r})"
                )
        if self.shard_urls and not self.database_url.startswith(DATABASE_SCHEMES[:2]):
            raise ValueError(f"{PREFIX}SHARDS needs {PREFIX}DATABASE_URL to name the Spider head (mysql://)")
        if self.queue_redis_url and not self.queue_redis_url.startswith(REDIS_SCHEMES[:3]):
            raise ValueError(
                f"{PREFIX}QUEUE_REDIS_URL must be one server: redis://, rediss:// or unix://"
                f" (got {redact(self.queue_redis_url)!r})"
            )
        for name in ("redis_url", "queue_redis_url", "database_url"):
            url = getattr(self, name)
            problem = url_problem(url)
            if problem:
                raise ValueError(f"{env_name(name)} {problem} (got {redact(url)!r})")
        if self.redis_url.startswith("redis+cluster://") and not self.queue_redis_url:
            raise ValueError(
                f"{PREFIX}QUEUE_REDIS_URL is required with a Redis Cluster: arq's queue needs one server"
            )
        if self.grab_durability not in ("", *DURABILITY):
            raise ValueError(
                f"{PREFIX}GRAB_DURABILITY must be one of {', '.join(DURABILITY)}"
                f" (got {self.grab_durability!r})"
            )

    def _check_numbers(self) -> None:
        """Every number within its declared bounds: finite, more than 0 or at least its ``least``, and at
        most its ``most``; every word one of its ``choices``."""
        for f in fields(self):
            value, choices = getattr(self, f.name), f.metadata["choices"]
            if choices and value not in choices:
                raise ValueError(f"{env_name(f.name)} is {' or '.join(choices)} (got {value!r})")
            if not isinstance(value, int | float) or isinstance(value, bool):
                continue
            least, most = f.metadata["least"], f.metadata["most"]
            if not math.isfinite(value) or (value < least if least is not None else value <= 0):
                at_least = "more than 0" if least is None else f"{least} or more"
                raise ValueError(f"{env_name(f.name)} must be a number {at_least} (got {value})")
            if most is not None and value > most:
                what = "a port number" if f.name.endswith("port") else "a number"
                span = f"at most {most}" if least is None else f"{least} to {most}"
                raise ValueError(f"{env_name(f.name)} must be {what}, {span} (got {value})")

    def _check_switches(self) -> None:
        """The demo switches, on a hub only this machine reaches and beside no chat backend."""
        on = [name for name in ("dev_login", "demo_topup") if getattr(self, name)]
        if not on:
            return
        what = f"{' and '.join(env_name(name) for name in on)} (on under `redpacket up`)"
        if not is_loopback(self.host):
            raise ValueError(
                f"{what} let anyone log in as any user and make money from nothing: only on a hub"
                f" listening on this machine alone (REDPACKET_HOST=127.0.0.1, got {self.host!r})"
            )
        if self.backend:
            raise ValueError(
                f"{what} never beside a chat backend (REDPACKET_SERVICE_KEY, REDPACKET_JWT_PUBLIC_KEY"
                " or REDPACKET_JWKS_URL is set): its users log in through it"
            )

    def _check_lists(self) -> None:
        """The settings written as lists or switches in text: origins, user ids, user groups."""
        for origin in self.allowed_origin_list:
            if origin != "self" and not re.fullmatch(r"https?://[a-z0-9.\-\[\]:]+", origin):
                raise ValueError(
                    f"{PREFIX}ALLOWED_ORIGINS holds origins such as https://chat.example.com (scheme, host,"
                    f" port if not the default; no path), or self (got {origin!r})"
                )
        for proxy in self.trusted_proxy_list:
            try:
                ipaddress.ip_network(proxy, strict=False)
            except ValueError:
                raise ValueError(
                    f"{PREFIX}TRUSTED_PROXIES holds addresses or networks such as 10.0.0.7 or"
                    f" 172.28.0.0/24, comma-separated (got {proxy!r}; names are not resolved)"
                ) from None
        if not re.fullmatch(r"(\d{1,19}(,\d{1,19})*)?", self.bot_exempt_users.replace(" ", "")):
            raise ValueError(
                f"{PREFIX}BOT_EXEMPT_USERS is user ids separated by commas (got {self.bot_exempt_users!r})"
            )
        if self.user_groups not in ("", "0", "1"):
            raise ValueError(f"{PREFIX}USER_GROUPS is 0 or 1, or empty (got {self.user_groups!r})")

    def to_env(self) -> dict[str, str]:
        """These settings as the environment a child process reads them from (``from_env`` gives them
        back, field for field): every setting by its variable, flags as 1 or 0."""
        out: dict[str, str] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[env_name(f.name)] = str(int(value)) if isinstance(value, bool) else str(value)
        return out

    def replace(self, **changes: object) -> Settings:
        """A copy with ``changes``. A new ``redis_url`` keeps the durability resolved here unless a
        ``grab_durability`` comes with it: the embedded Valkey's ``aof`` default must not become ``none``
        because the copy names the embedded server by its URL."""
        if "redis_url" in changes and "grab_durability" not in changes:
            changes["grab_durability"] = self.durability.value
        # (dataclasses.replace types its keyword values by field; these are checked by check().)
        return replace(self, **changes)  # type: ignore[arg-type]

    @property
    def embedded_redis(self) -> bool:
        """Whether Redis is the data directory's own Valkey: asked for by name (``embedded``), or left
        empty (which only ``up`` takes: ``server.cli``)."""
        return self.redis_url in ("", EMBEDDED)

    @property
    def redis_command_seconds(self) -> float:
        """How long a Redis command may go unanswered: ``redis_timeout_ms``, plus the wait for durability a
        grab's pipeline ends with (the server answers that wait only when it is over)."""
        waits = self.durability_timeout_ms if self.durability.waits else 0
        return (self.redis_timeout_ms + waits) / 1000

    @property
    def queue_url(self) -> str:
        return self.queue_redis_url or self.redis_url

    @property
    def sqlite_path(self) -> Path:
        return self.data_dir / "redpacket.sqlite3"

    @property
    def shard_urls(self) -> list[str]:
        """The backends of a sharded ledger, in shard order (``REDPACKET_SHARDS``)."""
        return [u.strip() for u in self.shards.split(",") if u.strip()]

    @property
    def effective_database_url(self) -> str:
        return self.database_url or f"sqlite:///{self.sqlite_path}"
