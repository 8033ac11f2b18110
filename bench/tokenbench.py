"""``redpacket bench tokens``: the CPU of one token check as a hub makes it on every connection and HTTP
call, for each kind of token, beside the check it replaced (the ``user.expires.hmac`` string) in the same
process. Pure CPU: no services."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from bench.report import report
from server.hub.tokens import Rules, Tokens, make_token, verify


def _cpu_us(check: Callable[[], object], n: int) -> float:
    start = time.process_time()
    for _ in range(n):
        check()
    return round((time.process_time() - start) / n * 1e6, 1)


def _seen_before_cpu_us(tokens: Tokens, token: str, n: int) -> float:
    """A hub's check of a token it checked before (a reconnect, the page's next API call)."""

    async def again() -> None:
        for _ in range(n):
            await tokens.user(token)

    asyncio.run(tokens.user(token))
    start = time.process_time()
    asyncio.run(again())
    return round((time.process_time() - start) / n * 1e6, 1)


def _pem(key: rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey) -> str:
    return (
        key.public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        .decode()
    )


def bench_tokens(n: int = 20_000, plot: Path | None = None) -> dict[str, Any]:
    now = int(time.time())
    secret = b"s" * 64
    body = f"42.{now + 600}"
    old = f"{body}.{hmac.new(secret, body.encode(), hashlib.sha256).hexdigest()}"

    def old_check() -> int:  # the token format before JWTs, checked as server/hub/tokens.py did
        user, expires, signature = old.split(".")
        mac = hmac.new(secret, f"{user}.{expires}".encode(), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(mac, signature) or int(expires) <= now:
            raise ValueError("bad token")
        return int(user)

    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ec_key = ec.generate_private_key(ec.SECP256R1())
    hs_rules = Rules(secret=secret)
    rsa_pem = _pem(rsa_key)
    rs_hub = Tokens(Rules(algorithms=("RS256",), public_key=rsa_pem))
    es_hub = Tokens(Rules(algorithms=("ES256",), public_key=_pem(ec_key)))
    hs = make_token(secret, 42, now, 600)
    rs = jwt.encode({"sub": "42", "exp": now + 600}, rsa_key, algorithm="RS256")
    es = jwt.encode({"sub": "42", "exp": now + 600}, ec_key, algorithm="ES256")
    few = max(1, n // 10)  # the public-key checks are slower: fewer of them
    figures = {
        "checks": n,
        "old_hmac_string_cpu_us_per_check": _cpu_us(old_check, n),
        "jwt_hs256_cpu_us_per_check": _cpu_us(lambda: verify(hs_rules, hs, secret), n),
        "jwt_rs256_cpu_us_per_check": _cpu_us(lambda: verify(rs_hub.rules, rs, rs_hub.public_key), few),
        "jwt_es256_cpu_us_per_check": _cpu_us(lambda: verify(es_hub.rules, es, es_hub.public_key), few),
        "jwt_rs256_pem_each_time_cpu_us_per_check": _cpu_us(lambda: verify(rs_hub.rules, rs, rsa_pem), few),
        "jwt_hs256_seen_before_cpu_us_per_check": _seen_before_cpu_us(Tokens(hs_rules), hs, n),
    }
    return report("tokens", figures, plot)
