"""The credit outboxes' backlog, as the worker's metrics and the console read it: the entries in each
shard's outbox (waiting for a worker, or claimed and being paid) and the oldest one's time. An outbox
entry's id is the Redis time it was written, its grab's, so the oldest id says how long a credit has
waited."""

from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis

from server.store import keys


@dataclass(frozen=True, slots=True)
class Backlog:
    depths: tuple[int, ...]  # entries per shard, shard 0 first
    oldest_ms: int | None  # the oldest entry's Redis time (ms); None when every outbox is empty

    @property
    def total(self) -> int:
        return sum(self.depths)


async def backlog(redis: Redis) -> Backlog:
    """One round trip: ``XLEN`` and the first entry of every shard's outbox."""
    async with redis.pipeline(transaction=False) as pipe:
        for n in range(keys.SHARDS):
            pipe.xlen(keys.credit_outbox(n))
            pipe.xrange(keys.credit_outbox(n), count=1)
        answers = await pipe.execute()
    firsts = [_entry_ms(entries[0][0]) for entries in answers[1::2] if entries]
    return Backlog(tuple(int(d) for d in answers[0::2]), min(firsts, default=None))


def _entry_ms(entry_id: bytes | str) -> int:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(text.split("-", 1)[0])
