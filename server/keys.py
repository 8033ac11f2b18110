"""Every Redis key and channel name the project uses, built here and nowhere else.

All keys of one packet share the hash tag ``{p<id>}`` (and of one group ``{g<id>}``, of one user
``{u<id>}``). The grab script is the exception that spans them, with the credit queue: one round trip per
grab on one standalone Redis.
"""

from __future__ import annotations


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


def packet_paid(packet_id: int) -> str:
    """Set of the seqs whose credit a worker has committed: a repeat grab does not queue them again."""
    return f"rp:{{p{packet_id}}}:paid"


def credit_queue(queue_name: str) -> str:
    """Sorted set of credits waiting to be paid, by when they became due (unix ms). A member is
    ``credit_entry(...)``: everything the worker needs, so nothing else is read to pay it."""
    return f"{queue_name}:credits"


def credit_claims(queue_name: str) -> str:
    """Sorted set of the credits workers are paying, by when each claim lapses (unix ms) unless renewed."""
    return f"{queue_name}:credits:claimed"


def credit_entry(packet_id: int, user_id: int, seq: int, amount: int, grabbed_ms: int) -> str:
    """``"<packet>:<user>:<seq>:<amount>:<grabbed_ms>"`` (``lua/grab.lua`` builds the same)."""
    return f"{packet_id}:{user_id}:{seq}:{amount}:{grabbed_ms}"


def parse_credit_entry(entry: bytes | str) -> tuple[int, int, int, int, int]:
    """(packet, user, seq, amount, grabbed_ms) of a ``credit_entry``."""
    text = entry.decode() if isinstance(entry, bytes) else entry
    packet, user, seq, amount, ms = (int(x) for x in text.split(":"))
    return packet, user, seq, amount, ms


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
