"""The signature of what redpacket POSTs to the chat backend — webhooks (``worker.webhooks``) and hooks
(``server.hub.hooks``) alike: ``Redpacket-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256 of "<t>." +
the raw body>``, as Stripe signs, so its receivers' code (and docs/integration.md's) checks both."""

from __future__ import annotations

import hashlib
import hmac

SIGNATURE_HEADER = "Redpacket-Signature"


def sign(secret: str, body: bytes, t: int, previous: str = "") -> str:
    """The ``Redpacket-Signature`` header's value for ``body`` sent at unix second ``t``; with the
    ``previous`` secret of a roll, a second ``v1=`` made with it (as Stripe signs during a roll), so a
    receiver holding either secret verifies."""
    macs = [
        hmac.new(s.encode(), f"{t}.".encode() + body, hashlib.sha256).hexdigest()
        for s in (secret, previous)
        if s
    ]
    return f"t={t}," + ",".join(f"v1={mac}" for mac in macs)


def same_secret(given: str, secret: str) -> bool:
    """Whether ``given`` is ``secret`` (never when the secret is empty), in a time that says nothing of
    either: their digests are compared, so not even their lengths show."""
    mine = hashlib.sha256(secret.encode()).digest()
    theirs = hashlib.sha256(given.encode("utf-8", "surrogatepass")).digest()  # (any text a body can hold)
    return bool(secret) and hmac.compare_digest(theirs, mine)
