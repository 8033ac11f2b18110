"""A database node lost, as the driver's errors and the URL tell it: a connection cut as it is made is a
lost node, and a URL of several hosts is read in order."""

from __future__ import annotations

from server.settings import url_problem
from server.store.db import RetryableError
from server.store.mysqlkit import as_ours, driver_error, node_lost, parse_url


def test_a_connection_cut_as_it_is_made_is_a_lost_node_not_a_bug() -> None:
    """aiomysql's RuntimeError when a node being killed closes a connection as it is made (seen in a
    Galera storm: the send was answered ``internal``) is the driver's, a lost node, retried."""
    cut = RuntimeError("Transport does not expose socket instance")
    assert driver_error(cut) and node_lost(cut)
    ours = as_ours(cut, moved=False)
    assert isinstance(ours, RetryableError) and ours.reason == "connection"
    assert not driver_error(RuntimeError("something of the caller's own"))


def test_a_url_of_several_hosts_is_read_in_order() -> None:
    t = parse_url("mysql://app:p%40ss@h1:3307,h2,[::1]:3309/ledger")
    assert t.hosts == (("h1", 3307), ("h2", 3306), ("::1", 3309))
    assert (t.user, t.password, t.database) == ("app", "p@ss", "ledger")
    assert [t.address(i) for i in range(3)] == ["h1:3307", "h2:3306", "[::1]:3309"]
    assert url_problem("mysql://u@h1:3306,h2:3306/db") == ""
    assert "cannot be read" in url_problem("mysql://u@h1:3306,h2:x/db")
    assert "names no host" in url_problem("mysql://u@h1:3306,/db")
