"""How durable a grab answered "won" is (``REDPACKET_GRAB_DURABILITY``): the levels and what each waits
for, read by the settings, the grab batcher and the worker's health sample."""

from __future__ import annotations

from enum import StrEnum


class Durability(StrEnum):
    """What a grab answered "won" survives (``REDPACKET_GRAB_DURABILITY``; docs/configuration.md says
    what each level waits for). Resolved once, by ``Settings.durability``."""

    NONE = "none"
    AOF = "aof"
    REPLICA = "replica"
    AOF_REPLICA = "aof+replica"

    @property
    def waits(self) -> bool:
        """Whether a grab's answer waits for anything (every level but none)."""
        return self is not Durability.NONE

    @property
    def fsyncs(self) -> bool:
        """Whether a grab waits for the master's fsync (WAITAOF; appendfsync always)."""
        return self in (Durability.AOF, Durability.AOF_REPLICA)

    @property
    def wants_replica(self) -> bool:
        """Whether a grab waits for a replica (``aof+replica``: while one could take the master's place)."""
        return self in (Durability.REPLICA, Durability.AOF_REPLICA)

    @property
    def degrades(self) -> bool:
        """Whether a grab goes on without a replica while its master has none that could take its place
        (``aof+replica``: on the master's fsync alone meanwhile)."""
        return self is Durability.AOF_REPLICA


# Every level, in the order docs/configuration.md lists them.
DURABILITY: tuple[Durability, ...] = tuple(Durability)
