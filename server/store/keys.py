"""Every Redis key and channel name the project uses, built here and nowhere else.

**One slot per script.** Every key of a group lives in its group's *shard*: one of ``SHARDS`` hash tags
``{s<n>}``, with ``n = group id mod SHARDS``. The group's member cache, its event stream and pub/sub
channel, its presence, its packets (meta, shares, grabs, grabs a repair dropped), each member's grab
bucket in it, the shard's gate (blocks and throttles, copied into every shard) and the shard's credit
outbox all share that tag. So the grab — member check, block, rate limit, the share, its credit record
— is one script on one slot, and runs on a Redis Cluster as on one server. A packet's keys need its
group id.

``SHARDS`` is part of where the data lives: changing it on a running system orphans every key. 64 hash
tags spread evenly enough over up to ~16 masters (docs/scaling.md).

Keys with no tag (the bot detector's attempt stream) are single-key; ``{ctl}`` holds the control
channel (membership changes) and the operators' list of blocks.

**One deployment's names.** Every key and channel starts ``rp:<namespace>:`` (plain ``rp:`` for a
deployment older than namespaces): two deployments on one Redis server — one database number or two,
since pub/sub ignores it — or one cluster never read, write or hear each other's. The namespace is the
database's deployment id (``schema.deployment_id``), read by every process; a process serves one
(``claim``).
"""

from __future__ import annotations

import re

from server.ids import GroupId, PacketId, UserId

SHARDS = 64
NAMESPACE = re.compile(r"[a-z0-9][a-z0-9-]{0,31}")
_namespace = ""
_claims = 0


def claim(namespace: str) -> None:
    """Name every key of this process with ``namespace`` (``""``: none, a deployment from before), while
    a Core holds it; ``release`` when it closes. A second namespace at once is a bug."""
    global _namespace, _claims
    if namespace and not NAMESPACE.fullmatch(namespace):
        raise ValueError(
            f"a namespace is 1 to 32 of a-z, 0-9 and -, starting with a letter or digit: {namespace!r}"
        )
    if _claims and namespace != _namespace:
        raise RuntimeError(f"this process already names its keys {_namespace!r}, not {namespace!r}")
    _namespace, _claims = namespace, _claims + 1


def release() -> None:
    global _claims
    _claims = max(0, _claims - 1)


def namespace() -> str:
    return _namespace


def _root() -> str:
    return f"rp:{_namespace}:" if _namespace else "rp:"


def shard(group_id: GroupId) -> int:
    """The shard of a group and of everything in it."""
    return group_id % SHARDS


def _g(group_id: GroupId) -> str:
    return f"{_root()}{{s{shard(group_id)}}}:g{group_id}"


def _p(group_id: GroupId, packet_id: PacketId) -> str:
    return f"{_root()}{{s{shard(group_id)}}}:p{packet_id}"


# -- packets --------------------------------------------------------------------------------------------


# The field of a packet's meta hash naming the server (run id and data id) its state was last loaded or
# checked on (``server.store.repair``).
PACKET_STAMP = "checked"


def packet_meta(*, group_id: GroupId, packet_id: PacketId) -> str:
    """Hash: group, sender, kind, total, count, target, created_ms, expires_ms, finished_ms, closed, and
    ``PACKET_STAMP``."""
    return _p(group_id, packet_id) + ":meta"


def packet_shares(*, group_id: GroupId, packet_id: PacketId) -> str:
    """List of shares not yet taken (``records.ShareEntry``), popped from the head."""
    return _p(group_id, packet_id) + ":shares"


def packet_grabs(*, group_id: GroupId, packet_id: PacketId) -> str:
    """Hash user id → ``records.GrabRecord``: who took which share, and when."""
    return _p(group_id, packet_id) + ":grabs"


def packet_dropped(*, group_id: GroupId, packet_id: PacketId) -> str:
    """List of grabs a repair took out of the packet because the database holds their share (or their
    user) otherwise (``records.DroppedEntry``): evidence kept beside the packet until the
    ledger has it (``credit_refusals``), whatever happens to the repair's own transaction."""
    return _p(group_id, packet_id) + ":dropped"


def packet_keys(*, group_id: GroupId, packet_id: PacketId) -> list[str]:
    """The keys of one packet, in the order every packet script takes them."""
    return [
        packet_meta(group_id=group_id, packet_id=packet_id),
        packet_shares(group_id=group_id, packet_id=packet_id),
        packet_grabs(group_id=group_id, packet_id=packet_id),
        packet_dropped(group_id=group_id, packet_id=packet_id),
    ]


# -- groups ---------------------------------------------------------------------------------------------


def group_members(group_id: GroupId) -> str:
    """Set of member user ids, a cache of the database; holds ``LOADED`` once it is complete."""
    return _g(group_id) + ":members"


def group_members_version(group_id: GroupId) -> str:
    """Counter bumped on every membership change; a cache reload that raced a change is discarded."""
    return _g(group_id) + ":mver"


# A member of every complete membership cache: an absent marker means "not loaded, ask the database".
LOADED = b"*"


def group_events(group_id: GroupId) -> str:
    """Stream of the group's recent events, capped; an event's offset is its stream id."""
    return _g(group_id) + ":events"


def group_channel(group_id: GroupId) -> str:
    """Sharded pub/sub channel where each of the group's events is published once, as
    ``<offset>\\n<payload>`` (``SPUBLISH``, from the script that appends it to the stream)."""
    return _g(group_id) + ":ch"


def channel_group(channel: bytes | str) -> GroupId | None:
    """The group id of a ``group_channel`` name, or None for any other channel."""
    text = channel.decode() if isinstance(channel, bytes) else channel
    head, _, rest = text.rpartition(":g")
    if head.startswith(_root() + "{s") and rest.endswith(":ch") and rest[:-3].isdigit():
        return GroupId(int(rest[:-3]))
    return None


def group_once(group_id: GroupId, event: str) -> str:
    """Present once an event that must be published at most once (a packet's announcement, its result,
    a retried grab announcement) has been: holds its offset. ``event`` names it, e.g. ``packet:17``."""
    return _g(group_id) + f":once:{event}"


def presence_online(group_id: GroupId) -> str:
    """Sorted set user id → when their presence lapses (unix ms) unless a hub refreshes it."""
    return _g(group_id) + ":online"


def presence_hubs(*, group_id: GroupId, user_id: UserId) -> str:
    """Hash hub id → lapse time: which hubs hold a connection of this user in this group."""
    return _g(group_id) + f":on:{user_id}"


def grab_bucket(*, group_id: GroupId, user_id: UserId) -> str:
    """Rate limit of one user's grab attempts in one group, every hub's: when the next is due (GCRA)."""
    return _g(group_id) + f":u{user_id}:rate"


# -- shards ---------------------------------------------------------------------------------------------


def shard_gate(n: int) -> str:
    """Hash of the bot detector's decisions, copied into every shard so that the grab script reads
    them in its own slot: ``b:<user>`` → block end (unix ms); ``t:<user>`` → ``"<grabs/s>:<end ms>"``."""
    return f"{_root()}{{s{n}}}:gate"


def gate_for(group_id: GroupId) -> str:
    return shard_gate(shard(group_id))


def credit_outbox(n: int) -> str:
    """Stream of the credits of the shard's grabs, written by the grab script next to the share, read by
    the workers' consumer group ``CREDIT_GROUP``, deleted once paid. Field ``c``: a
    ``records.CreditEntry``."""
    return f"{_root()}{{s{n}}}:credits"


def outbox_for(group_id: GroupId) -> str:
    return credit_outbox(shard(group_id))


CREDIT_GROUP = "pay"


# -- control, and keys that stand alone -----------------------------------------------------------------


def membership_channel() -> str:
    """Every hub hears every membership change here, to attach or detach its live connections."""
    return _root() + "{ctl}:membership"


def blocks() -> str:
    """Sorted set user id → when their block ends (unix ms): what operators list."""
    return _root() + "{ctl}:blocks"


def block_reasons() -> str:
    """Hash user id → why they are blocked; ``t:<user id>`` → why they are throttled."""
    return _root() + "{ctl}:block-reasons"


def reconciled() -> str:
    """Hash ``differences``, ``at`` (unix s), ``report`` (its JSON, the first differences only): the last
    reconciliation's outcome, whichever worker ran it — every worker's metrics report it (one worker runs
    each of the cron's ticks), the operators' console shows it."""
    return _root() + "{ctl}:reconciled"


def seen() -> str:
    """Hash ``hub:<id>`` / ``worker:<id>`` → what that process last said of itself (JSON, with
    ``seen_ms``): the hubs and workers the operators' console lists. Each process writes its own field."""
    return _root() + "{ctl}:seen"


def trace_of(move: str, packet_id: int, seq: int = 0) -> str:
    """String (a day): the W3C ``traceparent`` of the span that moved a packet's money (``send``; ``grab``
    of share ``seq``), written only while tracing (``server.tracing``): the webhook delivery of that
    move's event joins its trace."""
    return _root() + f"trace:{move}:{packet_id}:{seq}"


def throttles() -> str:
    """Sorted set user id → when their throttle ends (unix ms): listed for operators beside the blocks."""
    return _root() + "{ctl}:throttles"


def forgiven() -> str:
    """Hash user id → unix ms: an operator lifted their block or throttle then; their grab attempts until
    then are not scored again."""
    return _root() + "{ctl}:forgiven"


def grab_attempts() -> str:
    """Every grab attempt, for the bot detector: a capped stream (user, group, packet, reaction, device)."""
    return _root() + "attempts"
