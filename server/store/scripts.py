"""The one loader of the Lua scripts in ``lua/``.

Each ``lua/<name>.lua`` is read once and registered with redis-py, which calls it by EVALSHA and reloads
it by itself after a ``SCRIPT FLUSH`` or a Redis restart (NOSCRIPT → SCRIPT LOAD → EVALSHA again).
"""

from __future__ import annotations

from pathlib import Path

from redis.asyncio import Redis
from redis.commands.core import AsyncScript

from server.store.assets import asset_dir

LUA_DIR = asset_dir("lua")


def read_sources(directory: Path = LUA_DIR) -> dict[str, str]:
    """Every script's source by name (file stem)."""
    return {p.stem: p.read_text(encoding="utf-8") for p in sorted(directory.glob("*.lua"))}


class Scripts:
    """The registered scripts, one attribute per file."""

    grab: AsyncScript
    load_packet: AsyncScript
    fill_members: AsyncScript
    publish_event: AsyncScript
    presence: AsyncScript
    ack_credits: AsyncScript
    close_packet: AsyncScript
    read_events: AsyncScript

    def __init__(self, redis: Redis, directory: Path = LUA_DIR) -> None:
        self.sources = read_sources(directory)
        missing = set(self.__annotations__) - self.sources.keys()
        if missing:
            raise RuntimeError(f"Lua scripts missing from {directory}: {sorted(missing)}")
        self._scripts = {name: redis.register_script(src) for name, src in self.sources.items()}
        for name, script in self._scripts.items():
            setattr(self, name, script)

    def get(self, name: str) -> AsyncScript:
        """The script of ``lua/<name>.lua`` (``server.store.scriptcalls`` names it by its call). Read from
        the attribute, so that a test that replaces one (a Redis failing mid-call) replaces it for all."""
        script: AsyncScript = getattr(self, name)
        return script

    def sha(self, name: str) -> str:
        return str(self._scripts[name].sha)
