"""Every Redis key and channel name the project uses, built here and nowhere else.

All keys of one packet share the hash tag ``{p<id>}`` (and of one group ``{g<id>}``, of one user
``{u<id>}``). The grab script is the exception that spans them, with the arq queue: one round trip per
grab needs one standalone Redis, which arq's queue on the same server needs anyway.
"""

from __future__ import annotations

from arq.constants import in_progress_key_prefix, job_key_prefix, result_key_prefix

# arq's own prefixes of a job's key, of its kept result and of a worker's claim on it (the grab script
# builds credit job keys; the credit drain claims and finishes jobs as arq does).
JOB_KEY_PREFIX: str = job_key_prefix
RESULT_KEY_PREFIX: str = result_key_prefix
IN_PROGRESS_KEY_PREFIX: str = in_progress_key_prefix

# Every credit job id starts with this; the drain takes only such jobs from the shared queue.
CREDIT_JOB_ID_PREFIX = "credit:"


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


def credit_job_id_prefix(packet_id: int) -> str:
    """What the credit job ids of one packet's shares start with (``lua/grab.lua`` appends the seq)."""
    return f"{CREDIT_JOB_ID_PREFIX}{packet_id}:"


def credit_job_id(packet_id: int, seq: int) -> str:
    """arq job id of the credit of one share: enqueueing the same grab twice makes one job."""
    return credit_job_id_prefix(packet_id) + str(seq)


def credit_job_key(packet_id: int, seq: int) -> str:
    """Where arq keeps a queued credit job (arq owns the prefix)."""
    return job_key_prefix + credit_job_id(packet_id, seq)


def credit_result_key(packet_id: int, seq: int) -> str:
    """Where arq keeps a finished credit job's result; while it exists the job is not enqueued again."""
    return result_key_prefix + credit_job_id(packet_id, seq)


def group_events(group_id: int) -> str:
    """Stream of the group's recent events, capped; an event's offset is its stream id."""
    return f"rp:{{g{group_id}}}:events"


def group_channel(group_id: int) -> str:
    """Pub/sub channel where each of the group's events is published once, as ``<offset>\\n<payload>``."""
    return f"rp:{{g{group_id}}}:ch"


def group_once(group_id: int, event: str) -> str:
    """Present once an event that must be published at most once (a packet's announcement, its result,
    a retried grab announcement) has been: holds its offset. ``event`` names it, e.g. ``packet:17``."""
    return f"rp:{{g{group_id}}}:once:{event}"


def channel_group(channel: bytes | str) -> int | None:
    """The group id of a ``group_channel`` name, or None for any other channel."""
    text = channel.decode() if isinstance(channel, bytes) else channel
    if text.startswith("rp:{g") and text.endswith("}:ch"):
        return int(text[5:-4])
    return None


# Every hub hears every membership change here, to attach or detach its live connections.
MEMBERSHIP_CHANNEL = "rp:membership"


def presence_online(group_id: int) -> str:
    """Sorted set user id → when their presence lapses (unix ms) unless a hub refreshes it."""
    return f"rp:{{g{group_id}}}:online"


def presence_hubs(group_id: int, user_id: int) -> str:
    """Hash hub id → lapse time: which hubs hold a connection of this user in this group."""
    return f"rp:{{g{group_id}}}:on:{user_id}"


def grab_bucket(user_id: int) -> str:
    """Token bucket limiting one user's grab attempts (all hubs share it)."""
    return f"rp:{{u{user_id}}}:grabrate"


def user_block(user_id: int) -> str:
    """Present while the bot detector blocks this user from grabbing; its TTL is the block's length."""
    return f"rp:{{u{user_id}}}:block"


def grab_throttle(user_id: int) -> str:
    """Present while the bot detector throttles this user: its value is the grabs per second allowed."""
    return f"rp:{{u{user_id}}}:throttle"


# Every grab attempt, for the bot detector: a capped stream (user, group, packet, reaction, device).
GRAB_ATTEMPTS = "rp:attempts"
# Sorted set user id → when their block ends (unix ms): what operators list and lift.
BLOCKS = "rp:blocks"
