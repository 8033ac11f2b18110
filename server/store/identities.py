"""Which server answers at each Redis address, and with which data, read from what it says of itself.

A server's *run id* (``INFO server``) names its process; its *data id* (``role:master_replid`` from
``INFO replication``) changes whenever its data is replaced — a replica promoted takes a new replication
id, a master demoted turns replica and takes its new master's id and data. ``Identities`` records both per
address and counts every change in ``generation``: Redis may have lost writes then, so packets are
checked against the database before anyone grabs them again (``server.money.grabs.grab``).

``replicas_to_wait_for`` counts the replicas that could take a master's place (from ``INFO replication``
on one server, ``CLUSTER NODES`` on a cluster): a grab answered "won" must be on one of them too.

No I/O: ``server.store.redisnodes`` sends the commands and hands the answers here.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass
class Identities:
    """Which server answered at each address, and with which data: its run id (a process) and its data
    id (role and replication id); and a generation that counts the changes of either."""

    seen: dict[str, tuple[str, str]] = field(default_factory=dict)
    generation: int = 0
    # How many replicas could take each address's place, at the last look that counted them
    # (``replicas_to_wait_for``; ``aof+replica`` waits for one while there is one).
    replicas: dict[str, int] = field(default_factory=dict)
    # When each address's data id was last read (monotonic seconds).
    looked: dict[str, float] = field(default_factory=dict)
    # Each address's ``maxmemory-policy``, as it last said (``eviction_problem``).
    policies: dict[str, str] = field(default_factory=dict)

    def saw_policy(self, address: str, info: bytes | str) -> None:
        """Record the eviction policy an ``INFO`` answer with its memory section gives (a warning line when
        it turns into one that may drop keys)."""
        text = info.decode() if isinstance(info, bytes) else info
        policy = info_field(text, "maxmemory_policy:")
        if not policy:
            return  # (no memory section in this answer)
        before = self.policies.get(address)
        self.policies[address] = policy
        problem = eviction_problem(policy)
        if problem is not None and before is not None and policy != before:  # (start-up says the first)
            log.warning("Redis at %s: %s; grabs to it are refused", address, problem)
        elif problem is None and before is not None and eviction_problem(before) is not None:
            log.warning("Redis at %s: maxmemory-policy is %s again: grabs to it go on", address, policy)

    def evicting(self) -> dict[str, str]:
        """The addresses whose last known policy may drop keys, with that policy."""
        return {a: p for a, p in self.policies.items() if eviction_problem(p) is not None}

    def saw(
        self, address: str, run_id: str | None = None, data: str | None = None, look: bool = True
    ) -> bool:
        """Record what answered at ``address``; True if it differs from what was there before. ``look``:
        this was a batcher's look (``RedisNodes.look``), which counted its replicas too if they count."""
        if look:
            self.looked[address] = time.monotonic()
        before = self.seen.get(address)
        now = (
            run_id if run_id is not None else (before[0] if before else ""),
            data if data is not None else (before[1] if before else ""),
        )
        if before != now:
            if before is not None:
                log.warning(
                    "Redis at %s is another server or holds other data (run id %s, %s; was %s, %s):"
                    " packets are checked again",
                    address,
                    *now,
                    *before,
                )
            self.seen[address] = now
            self.generation += 1
            return before is not None
        return False


# How the batcher reads a server's data id (and its eviction policy) before a pipeline with a grab in it.
# Under this name of several words redis-py applies no reply callback: the answer stays the raw text
# ``data_id`` and ``Identities.saw_policy`` read.
DATA_ID_COMMAND = "INFO REPLICATION MEMORY"


def eviction_problem(policy: str) -> str | None:
    """Why a master whose ``maxmemory-policy`` is ``policy`` cannot keep grabs, or None. Only ``noeviction``
    can: under memory pressure it refuses writes (a grab answered ``redis_unavailable``), where every
    other policy drops keys to make room — ``allkeys-*`` any key, ``volatile-*`` the keys that expire,
    which a packet's shares and grabs are. A dropped packet is rebuilt from the database and its shares
    handed out again: a winner already told "won" is never paid, and nothing is left to show it."""
    if policy == "noeviction":
        return None
    return (
        f"maxmemory-policy is {policy}: under memory pressure Redis drops keys (a packet's shares and grabs"
        " expire, so volatile-* drops them too), and a grab answered won could go unpaid; set it to"
        " noeviction (CONFIG SET maxmemory-policy noeviction, and in its configuration)"
    )


# A pipeline with a grab in it, to a server whose data id was read longer ago than this, reads it first
# (a round trip more, once per this interval per busy server). Replacing a server's data takes its
# demotion, a full sync from another and its promotion: seconds in practice, never this little.
LOOK_FIRST_AFTER = 0.01


# Flags of a CLUSTER NODES row that is no node to talk to yet, and those of a replica no election
# promotes (``nofailover``: not automatically; an operator's CLUSTER FAILOVER still can).
NOT_A_NODE = frozenset({"handshake", "noaddr"})
UNELECTABLE = NOT_A_NODE | {"fail", "nofailover"}


def replicas_to_wait_for(info: bytes | str, cluster_nodes: bytes | str | None = None) -> int | None:
    """How many replicas could take a master's place, so that a grab answered "won" must be on one of
    them too: on a single server its ``connected_slaves`` (``INFO replication``) — every replica
    connected, in sync or still syncing (a Sentinel may promote one that is behind); on a cluster, from
    its ``CLUSTER NODES``, every replica of it not ``UNELECTABLE`` — connected or not, since a replica
    whose link to its master broke can still win its election. None when the answer does not say (no
    such field, no ``myself`` row): not counted, so waited for."""
    if cluster_nodes is None:
        text = info.decode() if isinstance(info, bytes) else info
        connected = info_field(text, "connected_slaves:")
        return int(connected) if connected.isdigit() else None
    rows = cluster_rows(cluster_nodes)
    me = next((row[0] for row in rows if "myself" in row[2].split(",")), None)
    if me is None:
        return None
    return sum(
        1
        for row in rows
        if row[3] == me and "slave" in (flags := set(row[2].split(","))) and not flags & UNELECTABLE
    )


def cluster_rows(cluster_nodes: bytes | str) -> list[list[str]]:
    """The rows of a ``CLUSTER NODES`` answer, each split into its fields (id, address, flags, master…)."""
    text = cluster_nodes.decode() if isinstance(cluster_nodes, bytes) else cluster_nodes
    return [row for row in (line.split() for line in text.splitlines()) if len(row) >= 8]


def data_id(info: bytes | str) -> str:
    """``role:master_replid`` from the text of ``INFO replication``: what changes when a server's data is
    replaced (a replica promoted takes a new replication id; a master demoted turns replica, then takes
    its new master's id and data)."""
    text = info.decode() if isinstance(info, bytes) else info
    return f"{info_field(text, 'role:')}:{info_field(text, 'master_replid:')}"


def info_field(text: str, name: str) -> str:
    """The value of ``name`` (``"role:"``) in the text of an ``INFO`` answer ("" when it is not there)."""
    at = text.find("\n" + name)
    if at < 0:
        return ""
    start = at + 1 + len(name)
    end = text.find("\r", start)
    return text[start : end if end >= 0 else len(text)].strip()
