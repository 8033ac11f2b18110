"""The send hook's answer as the hub reads it: only a 2xx JSON verdict is one."""

from __future__ import annotations

from server.hub.hooks import Allowed, Denied, NoAnswer, read_answer


def test_only_a_2xx_json_verdict_is_an_answer() -> None:
    assert read_answer(200, b'{"allow": true}') == Allowed()
    assert read_answer(200, b'{"allow": true, "greeting": "hi"}') == Allowed("hi")
    assert read_answer(200, b'{"allow": false, "reason": "kyc", "message": "m"}') == Denied("kyc", "m")
    assert read_answer(200, b'{"allow": false}') == Denied("denied", "the chat service declined this")
    for status, body in ((500, b'{"allow": true}'), (200, b"yes"), (200, b'{"allow": "true"}'), (204, b"")):
        assert isinstance(read_answer(status, body), NoAnswer), (status, body)
