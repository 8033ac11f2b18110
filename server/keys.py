"""Every Redis key and channel name the project uses, built here and nowhere else.

All keys of one packet share the hash tag ``{p<id>}`` (and of one group ``{g<id>}``), so every Lua
script touches a single slot and runs unchanged on Redis Cluster.
"""

from __future__ import annotations

from arq.constants import job_key_prefix, result_key_prefix


def packet_meta(packet_id: int) -> str:
    """Hash: group, sender, kind, total, count, target, created_ms, expires_ms, finished_ms, closed."""
    return f"rp:{{p{packet_id}}}:meta"


def packet_shares(packet_id: int) -> str:
    """List of shares not yet taken, ``"<seq>:<amount>"``, popped from the head."""
    return f"rp:{{p{packet_id}}}:shares"


def packet_grabs(packet_id: int) -> str:
    """Hash user id → ``"<seq>:<amount>:<grabbed_ms>"``: who took which share, and when."""
    return f"rp:{{p{packet_id}}}:grabs"


def packet_keys(packet_id: int) -> list[str]:
    """The keys of one packet, in the order every packet script takes them."""
    return [packet_meta(packet_id), packet_shares(packet_id), packet_grabs(packet_id)]


def group_members(group_id: int) -> str:
    """Set of member user ids, a cache of MySQL; holds ``LOADED`` once it is complete."""
    return f"rp:{{g{group_id}}}:members"


def group_members_version(group_id: int) -> str:
    """Counter bumped on every membership change; a cache reload that raced a change is discarded."""
    return f"rp:{{g{group_id}}}:mver"


# A member of every complete membership cache: an absent marker means "not loaded, ask the database".
LOADED = b"*"


def credit_job_id(packet_id: int, seq: int) -> str:
    """arq job id of the credit of one share: enqueueing the same grab twice makes one job."""
    return f"credit:{packet_id}:{seq}"


def credit_job_key(packet_id: int, seq: int) -> str:
    """Where arq keeps a queued credit job (arq owns the prefix)."""
    return job_key_prefix + credit_job_id(packet_id, seq)


def credit_result_key(packet_id: int, seq: int) -> str:
    """Where arq keeps a finished credit job's result; while it exists the job is not enqueued again."""
    return result_key_prefix + credit_job_id(packet_id, seq)
