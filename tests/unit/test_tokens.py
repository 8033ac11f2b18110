"""JWT tokens: HS256 with the hub's secret; RS256/ES256 with the backend's public key or its JWKS.

The pure check first (every way a token can be wrong), then the JWKS cache against a local HTTP server
(a thread of this process) that rotates its keys. (A real hub taking RS256 tokens over its socket and
HTTP API: ``tests/test_tokens.py``.)"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from server.errors import Unavailable
from server.hub import tokens as tokens_module
from server.hub.tokens import SEEN_TOKENS, Jwks, Rules, TokenError, Tokens, make_token, verify
from server.settings import Settings
from tests.hubtools import eventually
from tests.jwts import RSA, RSA_PUBLIC, now, rsa_key, signed
from tests.repofiles import says

SECRET = b"a-long-random-secret-of-the-hub-and-the-backend"
HS = Rules(secret=SECRET)
RS = Rules(algorithms=("RS256", "ES256"), public_key=RSA_PUBLIC)


def refused(rules: Rules, token: object, key: Any) -> str:
    with pytest.raises(TokenError) as e:
        verify(rules, token, key)
    return e.value.code


def test_a_valid_hs256_token_names_its_user_with_sub_as_digits_or_an_integer() -> None:
    assert verify(HS, signed(SECRET), SECRET) == 42
    assert verify(HS, signed(SECRET, sub=42), SECRET) == 42
    assert verify(HS, make_token(SECRET, 7, now(), 60), SECRET) == 7


def test_expired_and_not_yet_valid_tokens_are_refused_beyond_the_leeway() -> None:
    assert refused(HS, signed(SECRET, exp=now() - 60), SECRET) == "token_expired"
    assert verify(HS, signed(SECRET, exp=now() - 10), SECRET) == 42  # within 30 s of leeway
    assert refused(HS, signed(SECRET, nbf=now() + 120), SECRET) == "token_invalid"
    assert verify(HS, signed(SECRET, nbf=now() + 10), SECRET) == 42
    assert refused(replace(HS, leeway_seconds=0), signed(SECRET, exp=now() - 10), SECRET) == "token_expired"


def test_a_wrong_signature_a_missing_claim_and_bad_subjects_are_refused() -> None:
    assert refused(HS, signed(b"another secret entirely, just as long"), SECRET) == "token_invalid"
    assert refused(HS, signed(SECRET, exp=None), SECRET) == "token_invalid"
    assert refused(HS, signed(SECRET, sub=None), SECRET) == "token_invalid"
    for sub in ["²", "١", "0042", " 42", "-1", "0", str(2**63), 2**63, 0, -5, True, 4.2, "", "user42"]:
        assert refused(HS, signed(SECRET, sub=sub), SECRET) == "token_invalid", sub
    good = signed(SECRET)
    head, body, sig = good.split(".")
    for bad in ["", "garbage", f" {good}", f"{head}.{body}.{sig[:-1]}é", "红包.1.2", "a.b.c", None, 42]:
        assert refused(HS, bad, SECRET) == "token_invalid", bad


def test_alg_none_is_never_taken() -> None:
    unsigned = jwt.encode({"sub": "42", "exp": now() + 600}, None, algorithm="none")  # type: ignore[arg-type]
    assert refused(HS, unsigned, SECRET) == "token_invalid"
    assert refused(RS, unsigned, RSA_PUBLIC) == "token_invalid"


def test_no_algorithm_confusion_between_hmac_and_public_keys() -> None:
    # An HS256 token presented to an RS256 hub, even one "signed" with the hub's public key as its secret.
    assert refused(RS, signed(SECRET), RSA_PUBLIC) == "token_invalid"
    forged = hs256_by_hand({"sub": "42", "exp": now() + 600}, RSA_PUBLIC.encode())
    assert refused(RS, forged, RSA_PUBLIC) == "token_invalid"
    # An RS256 token presented to an HS256 hub.
    assert refused(HS, signed(RSA, "RS256"), SECRET) == "token_invalid"


def hs256_by_hand(claims: dict[str, Any], key: bytes) -> str:
    """An HS256 token made without PyJWT (which refuses a PEM key as an HMAC secret when signing)."""

    def b64(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

    head = b64(json.dumps({"alg": "HS256", "typ": "JWT"}).encode())
    body = b64(json.dumps(claims).encode())
    return f"{head}.{body}.{b64(hmac.new(key, f'{head}.{body}'.encode(), hashlib.sha256).digest())}"


def test_rs256_and_es256_with_keys_made_here() -> None:
    assert verify(RS, signed(RSA, "RS256"), RSA_PUBLIC) == 42
    ec_key = ec.generate_private_key(ec.SECP256R1())
    ec_public = ec_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    assert verify(RS, signed(ec_key, "ES256"), ec_public.decode()) == 42
    other, _ = rsa_key()
    assert refused(RS, signed(other, "RS256"), RSA_PUBLIC) == "token_invalid"  # someone else's key


def test_audience_and_issuer_are_checked_when_configured() -> None:
    rules = replace(RS, audience="redpacket", issuer="https://chat.example")
    ok = signed(RSA, "RS256", aud="redpacket", iss="https://chat.example")
    assert verify(rules, ok, RSA_PUBLIC) == 42
    assert (
        refused(rules, signed(RSA, "RS256", aud="other", iss="https://chat.example"), RSA_PUBLIC)
        == "token_invalid"
    )
    assert (
        refused(rules, signed(RSA, "RS256", aud="redpacket", iss="https://evil"), RSA_PUBLIC)
        == "token_invalid"
    )
    assert refused(rules, signed(RSA, "RS256", iss="https://chat.example"), RSA_PUBLIC) == "token_invalid"
    # Not configured: an audience in the token is not held against it.
    assert verify(RS, signed(RSA, "RS256", aud="anything"), RSA_PUBLIC) == 42


class KeyServer:
    """A JWKS endpoint on a local port whose keys the test swaps, counting the fetches."""

    def __init__(self) -> None:
        self.keys: list[dict[str, Any]] = []
        self.fetches = 0  # answered with the keys
        self.asked = 0  # requests, whatever their answer
        self.up = True
        self.hold: threading.Event | None = None  # set: requests hang until it is
        self.redirect_to = ""
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.asked += 1
                if outer.hold is not None:
                    outer.hold.wait(30)
                if outer.redirect_to:
                    self.send_response(302)
                    self.send_header("location", outer.redirect_to)
                    self.end_headers()
                    return
                if not outer.up:
                    self.send_error(503)
                    return
                outer.fetches += 1
                body = json.dumps({"keys": outer.keys}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/.well-known/jwks.json"

    def publish(self, *pairs: tuple[str, rsa.RSAPrivateKey]) -> None:
        self.keys = [
            {**json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(key.public_key())), "kid": kid, "alg": "RS256"}
            for kid, key in pairs
        ]

    @contextmanager
    def running(self) -> Iterator[KeyServer]:
        thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self.server.shutdown()
            self.server.server_close()


async def test_a_jwks_with_a_rotating_kid_is_fetched_again_for_a_new_key_within_a_bound() -> None:
    first, second = rsa_key()[0], rsa_key()[0]
    with KeyServer().running() as keys:
        keys.publish(("k1", first))
        tokens = Tokens(Rules(algorithms=("RS256",), jwks_url=keys.url))
        tokens.jwks = Jwks(keys.url, min_refresh_seconds=0)
        assert await tokens.user(signed(first, "RS256", headers={"kid": "k1"})) == 42
        assert await tokens.user(signed(first, "RS256", headers={"kid": "k1"}, sub="43")) == 43
        assert keys.fetches == 1  # cached

        # The backend rotates to k2: a token with the new kid makes the hub fetch again.
        keys.publish(("k2", second))
        assert await tokens.user(signed(second, "RS256", headers={"kid": "k2"})) == 42
        assert keys.fetches == 2
        with pytest.raises(TokenError):  # k1 is gone from the set (a token not checked before)
            await tokens.user(signed(first, "RS256", headers={"kid": "k1"}, sub="44"))
        with pytest.raises(TokenError):  # a token signed by a key that is not the kid's
            await tokens.user(signed(first, "RS256", headers={"kid": "k2"}))

        # Unknown kids from a stranger: one fetch per bound, not one per token.
        tokens.jwks = Jwks(keys.url)
        assert await tokens.user(signed(second, "RS256", headers={"kid": "k2"}, sub="45")) == 45
        before = keys.fetches
        for i in range(20):
            with pytest.raises(TokenError):
                await tokens.user(signed(second, "RS256", headers={"kid": f"made-up-{i}"}))
        assert keys.fetches == before
        # An HS256 token never causes a fetch at all.
        with pytest.raises(TokenError):
            await tokens.user(signed(SECRET, headers={"kid": "k3"}))
        assert keys.fetches == before

        # The endpoint down: keys already held stay in use; a hub with none says it cannot check yet.
        keys.up = False
        tokens.jwks.fetched_at = float("-inf")
        assert await tokens.user(signed(second, "RS256", headers={"kid": "k2"}, sub="46")) == 46
        assert keys.fetches == before  # it tried (the endpoint said 503) and kept what it held
        cold = Tokens(Rules(algorithms=("RS256",), jwks_url=keys.url))
        with pytest.raises(Unavailable) as down:
            await cold.user(signed(second, "RS256", headers={"kid": "k2"}))
        assert down.value.code == "auth_unavailable"


async def test_a_token_checked_once_is_remembered_but_never_past_its_exp(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[object] = []
    real = tokens_module.checked

    def counted(rules: Rules, token: object, key: Any) -> tuple[int, int]:
        calls.append(token)
        return real(rules, token, key)

    monkeypatch.setattr(tokens_module, "checked", counted)
    tokens = Tokens(replace(HS, leeway_seconds=5))
    exp = now() + 120
    token = signed(SECRET, exp=exp)
    assert await tokens.user(token) == 42
    assert await tokens.user(token) == 42
    assert len(calls) == 1  # the second time from memory
    tokens.clock = lambda: exp + 5  # past its exp and the leeway: checked again, never taken from memory
    assert await tokens.user(token) == 42
    assert len(calls) == 2
    # Bad tokens are never remembered, and the memory is bounded.
    bad = signed(b"another secret entirely, just as long")
    for _ in range(2):
        with pytest.raises(TokenError):
            await tokens.user(bad)
    assert len(calls) == 4
    tokens.clock = time.time
    for i in range(SEEN_TOKENS + 50):
        await tokens.user(make_token(SECRET, i + 1, now(), 600))
    assert len(tokens._seen) <= SEEN_TOKENS


@pytest.mark.parametrize(
    ("url", "ok"),
    [
        ("https://auth.example/.well-known/jwks.json", True),
        ("http://127.0.0.1:9000/jwks.json", True),
        ("http://localhost/jwks.json", True),
        ("http://auth.example/.well-known/jwks.json", False),
        ("ftp://auth.example/jwks.json", False),
    ],
)
def test_a_jwks_is_fetched_over_https_or_from_this_machine_only(url: str, ok: bool) -> None:
    s = Settings(jwks_url=url)
    if ok:
        s.check()
    else:
        with pytest.raises(ValueError, match="JWKS_URL must be https"):
            s.check()


async def test_a_jwks_behind_a_redirect_is_not_used() -> None:
    """A plain-http JWKS behind a 302 was used. A redirect is now a failed fetch."""
    key = rsa_key()[0]
    with KeyServer().running() as real, KeyServer().running() as hop:
        real.publish(("k1", key))
        hop.redirect_to = real.url
        tokens = Tokens(Rules(algorithms=("RS256",), jwks_url=hop.url))
        with pytest.raises(Unavailable) as refused:
            await tokens.user(signed(key, "RS256", headers={"kid": "k1"}))
        assert refused.value.code == "auth_unavailable" and "redirect" in refused.value.message
        assert real.fetches == 0


async def test_a_jwks_down_answers_every_waiting_token_with_one_fetch_and_remembers_it() -> None:
    """With the JWKS down, four concurrent connections were answered after 5.1 / 10.0 / 15.0 / 19.9 s:
    each waited for the one before it to try its own fetch. Now one fetch is shared by all four, its
    failure is remembered (the next try backs off), and a token whose key is held never waits behind a
    fetch at all."""
    key, other = rsa_key()[0], rsa_key()[0]
    with KeyServer().running() as keys:
        keys.publish(("k1", key))
        tokens = Tokens(Rules(algorithms=("RS256",), jwks_url=keys.url))
        assert tokens.jwks is not None
        tokens.jwks.min_refresh_seconds = 30  # (so the backoff outlasts the test)
        assert await tokens.user(signed(key, "RS256", headers={"kid": "k1"})) == 42
        assert keys.fetches == 1
        keys.hold = threading.Event()  # the endpoint hangs now, as a dead backend's does
        tokens.jwks.fetched_at = float("-inf")  # due for a fetch
        waiting = [
            asyncio.create_task(tokens.user(signed(other, "RS256", headers={"kid": f"junk-{i}"})))
            for i in range(4)
        ]
        await eventually(lambda: keys.asked == 2, timeout=10)  # the one fetch is in flight
        # A token whose key is held is answered while the fetch hangs.
        assert await tokens.user(signed(key, "RS256", headers={"kid": "k1"}, sub="43")) == 43
        assert not any(t.done() for t in waiting)
        keys.up = False
        keys.hold.set()  # the fetch fails: every waiting token is answered by it
        outcomes = await asyncio.gather(*waiting, return_exceptions=True)
        assert all(isinstance(o, TokenError) and o.code == "token_invalid" for o in outcomes), outcomes
        assert keys.asked == 2 and tokens.jwks.failures == 1
        # Remembered: another unknown kid is answered at once, without a fetch, until the backoff ends.
        with pytest.raises(TokenError):
            await tokens.user(signed(other, "RS256", headers={"kid": "junk-5"}))
        assert keys.asked == 2


def test_token_claims_are_read_as_the_document_says() -> None:
    """Before: a digit string as exp was taken (RFC 7519 says a number); the rest was not written down."""
    says(
        '`sub` the user id (an integer, or a string of ASCII digits with no leading zero — `"071"` is refused'
    )
    says("`exp`, `nbf`, `iat` are numbers (RFC 7519's NumericDate: a string of digits is refused)")
    says(
        "`aud` / `iss` checked when the hub has `REDPACKET_JWT_AUDIENCE` / `REDPACKET_JWT_ISSUER`,"
        " ignored otherwise"
    )
    secret = b"s" * 32
    rules = Rules(secret=secret)
    now = int(time.time())

    def token(**claims: object) -> str:
        return jwt.encode({"sub": "71", "exp": now + 60, **claims}, secret, algorithm="HS256")

    assert verify(rules, token(), secret) == 71
    assert verify(rules, token(aud="someone", iss="somewhere"), secret) == 71  # not configured: not checked
    for bad in ({"sub": "071"}, {"exp": str(now + 60)}, {"iat": str(now)}, {"nbf": str(now)}):
        with pytest.raises(TokenError) as refused:
            verify(rules, token(**bad), secret)
        assert refused.value.code == "token_invalid", bad
