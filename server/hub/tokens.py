"""Who a token says its holder is: a JWT (RFC 7519) that the chat app's backend mints, checked with PyJWT.

- **HS256** with ``REDPACKET_SECRET`` (the default, and what ``/api/login`` of a dev hub issues), or
- **RS256 / ES256** with the backend's public key (``REDPACKET_JWT_PUBLIC_KEY``) or its JWKS
  (``REDPACKET_JWKS_URL``, https — plain http to this machine only: fetched at start-up with a time
  bound and no redirects, cached, fetched again for an unknown ``kid`` at most every
  ``JWKS_MIN_REFRESH_SECONDS``, one fetch at a time, a failure backed off: ``Jwks``).

A hub takes one family only: an HS256 token is refused by a hub that checks RS256, and the other way round,
so a public key can never be used as an HMAC secret (algorithm confusion); ``alg: none`` is never taken.
Claims: ``sub`` the user id (a string of digits or an integer, 1 to 2⁶³−1), ``exp`` required, ``nbf`` and
``iat`` checked when present, ``aud`` / ``iss`` when the hub is configured with them, all with a small
leeway for clocks. ``verify`` is pure; ``Tokens`` adds the JWKS cache, the only I/O here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import jwt
from cryptography.hazmat.primitives.serialization import load_pem_public_key

from server import errors
from server.errors import RedPacketError, Unavailable
from server.ids import MAX_ID, UserId
from server.settings import Settings

log = logging.getLogger(__name__)

HMAC_ALGORITHMS = ("HS256",)
KEY_ALGORITHMS = ("RS256", "ES256")
JWKS_TTL_SECONDS = 300.0
JWKS_MIN_REFRESH_SECONDS = 10.0
JWKS_TIMEOUT_SECONDS = 5.0
JWKS_MAX_BACKOFF_SECONDS = 60.0
JWKS_MAX_BYTES = 1 << 20
MAX_TOKEN_CHARS = 8192
SEEN_TOKENS = 10_000
SEEN_SECONDS = 300.0


class TokenError(RedPacketError):
    pass


@dataclass(frozen=True)
class Rules:
    """What a hub accepts: the algorithms, where the key comes from, and the claims it checks."""

    algorithms: tuple[str, ...] = HMAC_ALGORITHMS
    secret: bytes = b""
    public_key: str = ""  # PEM
    jwks_url: str = ""
    audience: str = ""
    issuer: str = ""
    leeway_seconds: int = 30

    @classmethod
    def from_settings(cls, s: Settings) -> Rules:
        return cls(
            algorithms=s.jwt_algorithm_list,
            secret=s.secret.encode(),
            public_key=s.jwt_public_key_pem(),
            jwks_url=s.jwks_url,
            audience=s.jwt_audience,
            issuer=s.jwt_issuer,
            leeway_seconds=s.jwt_leeway_seconds,
        )

    @property
    def hmac(self) -> bool:
        return self.algorithms == HMAC_ALGORITHMS


def make_token(secret: bytes, user_id: int, now: int, ttl_seconds: int, **claims: Any) -> str:
    """An HS256 JWT for ``user_id`` that expires ``ttl_seconds`` after ``now`` (dev login, tests)."""
    body = {"sub": str(user_id), "iat": now, "exp": now + ttl_seconds, **claims}
    return jwt.encode(body, secret, algorithm="HS256")


def user_of(sub: object) -> UserId:
    """The user id a ``sub`` claim names: ASCII digits or an integer, 1 to 2⁶³−1."""
    if isinstance(sub, str):
        sub = int(sub) if sub.isascii() and sub.isdigit() and len(sub) <= 19 and sub[0] != "0" else None
    if not isinstance(sub, int) or isinstance(sub, bool) or not 1 <= sub <= MAX_ID:
        raise TokenError(errors.TOKEN_INVALID, "sub must be a user id: 1 to 2^63-1, as digits or an integer")
    return UserId(sub)


def _text(token: object) -> str:
    if not isinstance(token, str) or not token or len(token) > MAX_TOKEN_CHARS:
        raise TokenError(errors.TOKEN_INVALID, "no token, or not a JWT")
    return token


def header_of(token: object) -> dict[str, Any]:
    """The token's header, unverified; ``token_invalid`` when it is not a JWT at all."""
    token = _text(token)
    try:
        return dict(jwt.get_unverified_header(token))
    except jwt.PyJWTError as e:
        raise TokenError(errors.TOKEN_INVALID, f"not a JWT: {e}") from None


def verify(rules: Rules, token: object, key: Any) -> UserId:
    """The user id of a token signed with ``key``, under ``rules``; ``TokenError`` otherwise."""
    return checked(rules, token, key)[0]


def checked(rules: Rules, token: object, key: Any) -> tuple[UserId, int]:
    """(the user id, the ``exp``) of a token signed with ``key``, under ``rules``; ``TokenError``
    otherwise."""
    try:
        # PyJWT parses the header once and refuses an alg not listed (``none`` never is).
        claims = jwt.decode(
            _text(token),
            key,
            algorithms=list(rules.algorithms),
            audience=rules.audience or None,
            issuer=rules.issuer or None,
            leeway=rules.leeway_seconds,
            options={
                "require": ["exp", "sub"],
                "verify_aud": bool(rules.audience),
                "verify_sub": False,  # an integer sub is taken too: user_of checks it
            },
        )
    except jwt.ExpiredSignatureError:
        raise TokenError(errors.TOKEN_EXPIRED, "token expired") from None
    except (jwt.PyJWTError, ValueError, TypeError) as e:
        # Bad signature, not yet valid, wrong audience or issuer, a missing claim, a key of the wrong kind.
        raise TokenError(errors.TOKEN_INVALID, str(e) or type(e).__name__) from None
    for name in ("exp", "nbf", "iat"):  # NumericDate (RFC 7519): a JSON number, never a string of digits
        value = claims.get(name)
        if name in claims and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise TokenError(errors.TOKEN_INVALID, f"{name} must be a number (seconds since the epoch)")
    return user_of(claims.get("sub")), int(claims["exp"])


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A JWKS is fetched from its URL or not at all: a redirect (to plain http, to another host) is a
    failed fetch."""

    def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any, newurl: str) -> None:
        raise urllib.error.HTTPError(req.full_url, code, f"redirect to {newurl} refused", headers, fp)


_OPENER = urllib.request.build_opener(_NoRedirects)


@dataclass
class Jwks:
    """The backend's published keys, by ``kid``: fetched at the hub's start, kept ``ttl_seconds``, fetched
    again early for an unknown ``kid`` (a rotation) but never more often than ``min_refresh_seconds``, so
    that tokens with made-up kids cannot make the hub fetch once each.

    One fetch at a time, shared: a token waits for it only when its ``kid`` is not held (a token whose key
    is held never waits; keys past their ``ttl_seconds`` are fetched again behind it). A failed fetch
    keeps the keys held, and is remembered: the next is tried ``min_refresh_seconds`` later, doubling up
    to ``JWKS_MAX_BACKOFF_SECONDS`` — meanwhile a token whose key is not held is refused at once
    (``auth_unavailable``), not queued behind another try."""

    url: str
    ttl_seconds: float = JWKS_TTL_SECONDS
    min_refresh_seconds: float = JWKS_MIN_REFRESH_SECONDS
    keys: dict[str, jwt.PyJWK] = field(default_factory=dict)
    fetched_at: float = float("-inf")  # when a fetch last succeeded, or was last tried
    failures: int = 0  # fetches failed in a row
    error: str = ""  # why the last one failed
    _fetch: asyncio.Future[None] | None = None

    def _download(self) -> dict[str, jwt.PyJWK]:
        try:
            with _OPENER.open(self.url, timeout=JWKS_TIMEOUT_SECONDS) as r:
                data = json.loads(r.read(JWKS_MAX_BYTES))
        except urllib.error.HTTPError as e:
            e.close()  # an error status holds its response open
            raise
        found: dict[str, jwt.PyJWK] = {}
        for raw in data.get("keys", []):
            if raw.get("use", "sig") != "sig" or "kid" not in raw:
                continue
            try:
                found[str(raw["kid"])] = jwt.PyJWK(raw)
            except jwt.PyJWTError as e:
                log.warning("JWKS key %s skipped: %s", raw.get("kid"), e)
        return found

    def _wait(self) -> float:
        """How long after the last fetch the next may be tried."""
        if not self.failures:
            return self.min_refresh_seconds
        return min(JWKS_MAX_BACKOFF_SECONDS, self.min_refresh_seconds * float(2 ** (self.failures - 1)))

    def refresh(self) -> asyncio.Future[None]:
        """The fetch in flight, or a new one: every caller shares it."""
        if self._fetch is None or self._fetch.done():
            self._fetch = asyncio.ensure_future(self._fetch_now())
            self._fetch.add_done_callback(lambda f: f.cancelled() or f.exception())  # (retrieved)
        return self._fetch

    async def _fetch_now(self) -> None:
        try:
            keys = await asyncio.to_thread(self._download)
        except Exception as e:  # unreachable, slow, redirected, not JSON: keep what we had
            self.failures += 1
            self.error = str(e) or type(e).__name__
            log.warning("JWKS %s could not be fetched (%d in a row): %s", self.url, self.failures, self.error)
            raise
        else:
            self.keys, self.failures, self.error = keys, 0, ""
        finally:
            self.fetched_at = time.monotonic()

    async def key(self, kid: object) -> jwt.PyJWK:
        if not isinstance(kid, str):
            raise TokenError(errors.TOKEN_INVALID, "a token checked against a JWKS needs a kid")
        age = time.monotonic() - self.fetched_at
        may_fetch = age > self._wait()
        if kid in self.keys:
            if age > self.ttl_seconds and may_fetch:
                self.refresh()  # behind this token, not before it
            return self.keys[kid]
        if may_fetch or (self._fetch is not None and not self._fetch.done()):
            with contextlib.suppress(Exception):
                await asyncio.shield(self.refresh())
        found = self.keys.get(kid)
        if found is not None:
            return found
        if self.failures and not self.keys:
            raise Unavailable(errors.AUTH_UNAVAILABLE, f"the JWKS could not be fetched: {self.error}")
        raise TokenError(errors.TOKEN_INVALID, f"no key {kid!r} in the JWKS")


class Tokens:
    """The hub's token check: ``await tokens.user(token)`` is the user id, or ``TokenError``.

    A token checked once is remembered (``SEEN_TOKENS`` of them, each for at most ``SEEN_SECONDS`` and never
    past its ``exp``): a client reconnecting, or the page calling the API, shows the same token again and
    again, and PyJWT's check costs a hundred microseconds of CPU (``redpacket bench tokens``)."""

    def __init__(self, rules: Rules) -> None:
        self._seen: dict[str, tuple[UserId, float]] = {}  # token → (user id, good until, unix seconds)
        self.clock = time.time
        self.rules = rules
        self.jwks = Jwks(rules.jwks_url) if rules.jwks_url else None
        # Parsed once: PyJWT would parse the PEM on every check (a third of an RS256 check's CPU).
        self.public_key = load_pem_public_key(rules.public_key.encode()) if rules.public_key else None

    async def user(self, token: object) -> UserId:
        now = self.clock()
        seen = self._seen.get(token) if isinstance(token, str) else None
        if seen is not None and now < seen[1]:
            return seen[0]
        user, exp = await self._check(token)
        if len(self._seen) >= SEEN_TOKENS:
            for old in list(self._seen)[: SEEN_TOKENS // 10]:  # the oldest tenth
                del self._seen[old]
        # (token is a str here: a non-str never reaches _check's success.)
        self._seen[token] = (user, min(exp + self.rules.leeway_seconds, now + SEEN_SECONDS))  # type: ignore[index]
        return user

    async def _check(self, token: object) -> tuple[UserId, int]:
        if self.rules.hmac:
            return checked(self.rules, token, self.rules.secret)
        if self.jwks is None:
            return checked(self.rules, token, self.public_key)
        header = header_of(token)
        if header.get("alg") not in self.rules.algorithms:  # before any fetch a stranger could cause
            accepted = ", ".join(self.rules.algorithms)
            raise TokenError(
                errors.TOKEN_INVALID, f"alg {header.get('alg')!r} is not accepted here ({accepted})"
            )
        jwk = await self.jwks.key(header.get("kid"))
        if jwk.algorithm_name != header.get("alg"):
            raise TokenError(errors.TOKEN_INVALID, "the token's alg is not its key's")
        return checked(self.rules, token, jwk.key)
