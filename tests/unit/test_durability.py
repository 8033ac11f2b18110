"""What a durable grab waits for, from what Redis says: which replicas could take a master's place (INFO and
CLUSTER NODES as a master answers them), and the WAITAOF / WAIT a durable pipeline sends and when it falls
short."""

from __future__ import annotations

import pytest

from server.durability import Durability
from server.store import redisnodes
from server.store.batch import _shortfall, _waits

ME = "e7d1eecce10fd6bb5eb35b9f99a514335d9ba9ca"
OTHER = "67ed2db8d677e59ec4a4cefb06858cf2a1a89fa1"


def _nodes(*replica_flags: str) -> str:
    """CLUSTER NODES as a master answers it: itself, another master with a replica of its own, and one
    replica of itself per flags given."""
    rows = [
        f"{ME} 127.0.0.1:30001@31001 myself,master - 0 0 1 connected 0-8191",
        f"{OTHER} 127.0.0.1:30002@31002 master - 0 1426238316232 2 connected 8192-16383",
        f"6ec23923021cf3ffec47632106199cb7f496ce01 127.0.0.1:30005@31005 slave {OTHER} 0 1 5 connected",
    ]
    rows += [
        f"{n:040x} 127.0.0.1:{30010 + n}@{31010 + n} {flags} {ME} 0 1426238317239 4 connected"
        for n, flags in enumerate(replica_flags)
    ]
    return "\n".join(rows) + "\n"


INFO_ALONE = "# Replication\r\nrole:master\r\nconnected_slaves:0\r\nmaster_replid:ab\r\n"
INFO_SYNCING = (
    "# Replication\r\nrole:master\r\nconnected_slaves:1\r\n"
    "slave0:ip=127.0.0.1,port=30010,state=wait_bgsave,offset=0,lag=0\r\nmaster_replid:ab\r\n"
)


@pytest.mark.parametrize(
    ("info", "nodes", "count"),
    [
        (INFO_ALONE, None, 0),
        (INFO_SYNCING, None, 1),  # syncing still counts: a Sentinel may promote it
        (INFO_ALONE, _nodes(), 0),
        (INFO_ALONE, _nodes("slave"), 1),  # its link down (INFO lists none): it can still win an election
        (INFO_ALONE, _nodes("slave,fail?"), 1),  # one node's doubt is not the cluster's word
        (INFO_ALONE, _nodes("slave,fail"), 0),
        (INFO_ALONE, _nodes("slave,nofailover"), 0),
        (INFO_ALONE, _nodes("slave,handshake", "slave,noaddr"), 0),
        (INFO_SYNCING, _nodes("slave,fail", "slave"), 1),
        ("# Replication\r\nrole:master\r\n", None, None),  # not said: not counted (waited for)
        (INFO_ALONE, _nodes().replace("myself,", ""), None),
    ],
    ids=[
        "alone",
        "syncing",
        "no-replica",
        "link-down",
        "pfail",
        "fail",
        "nofailover",
        "not-yet",
        "one-of-two",
        "info-unsaid",
        "no-myself",
    ],
)
def test_the_replicas_that_could_take_a_masters_place(
    info: str, nodes: str | None, count: int | None
) -> None:
    assert redisnodes.replicas_to_wait_for(info, nodes) == count


def test_what_a_durable_pipeline_waits_for_and_when_it_falls_short() -> None:
    assert _waits(Durability.NONE, None) == []
    assert _waits(Durability.AOF, 0) == [("WAITAOF", 1, 0)]
    assert _waits(Durability.REPLICA, 0) == [("WAIT", 1)]  # no replica: it falls short, never answered alone
    assert _waits(Durability.AOF_REPLICA, 0) == [("WAITAOF", 1, 0)]
    assert _waits(Durability.AOF_REPLICA, 1) == [("WAITAOF", 1, 0), ("WAIT", 1)]
    # Not counted yet: assume one.
    assert _waits(Durability.AOF_REPLICA, None) == [("WAITAOF", 1, 0), ("WAIT", 1)]
    assert _shortfall(("WAITAOF", 1, 0), [1, 0]) is None
    assert _shortfall(("WAITAOF", 1, 0), [0, 0]) == "the grab is not yet on disk: retry"
    assert _shortfall(("WAIT", 1), 1) is None
    assert _shortfall(("WAIT", 1), 0) == "no replica has the grab yet: retry"
    assert "could not be made durable (WAITAOF)" in str(_shortfall(("WAITAOF", 1, 0), RuntimeError("x")))
