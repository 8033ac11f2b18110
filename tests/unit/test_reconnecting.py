"""The reconnecting client's choice on each way a connection ends (``redpacket_client.reconnecting``):
retried, or stopped with the reason."""

from __future__ import annotations

from redpacket_client.reconnecting import decide, stop_code


def test_what_each_close_code_leads_to() -> None:
    retried = [None, 1000, 1006, 1011, 1012, 1013, 4008, 4029, 4030, -503, -429]
    assert [decide(code, "") for code in retried] == ["retry"] * len(retried)
    assert decide(4001, "token_expired") == "refresh"
    assert [decide(code, "token_invalid") for code in (4001, 4004, 1008, -403)] == ["stop"] * 4
    assert [stop_code(c, r) for c, r in [(4004, "user_not_found"), (-403, "http 403"), (1008, "")]] == [
        "user_not_found",
        "http_403",
        "close_1008",
    ]
