"""Tokens as a chat backend signs them, for tests: an RSA key pair made here (its public half as a PEM
string, what the hub is given) and JWTs signed with any key, algorithm and claims."""

from __future__ import annotations

import time
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa


def now() -> int:
    return int(time.time())


def rsa_key() -> tuple[rsa.RSAPrivateKey, str]:
    """A new RSA key and its public half as PEM."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return key, pem.decode()


RSA, RSA_PUBLIC = rsa_key()


def signed(key: Any, alg: str = "HS256", headers: dict[str, Any] | None = None, **claims: Any) -> str:
    """A JWT for user 42 valid for ten minutes, with ``claims`` over those (a claim given None left out)."""
    body = {"sub": "42", "exp": now() + 600, **claims}
    return jwt.encode({k: v for k, v in body.items() if v is not None}, key, algorithm=alg, headers=headers)
