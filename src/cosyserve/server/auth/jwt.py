"""OIDC / JWT bearer tokens, verified against a JSON Web Key Set (a URL or a file).

A token passes when its signature verifies with the key set's key of its ``kid`` (with an
allowed algorithm), and its issuer, audience and expiry (``exp`` is required) check out.
The key set is cached and fetched again after ``refresh_s``, or sooner when a token names
a key it does not hold (the issuer rotated keys), at most once per ``_MIN_REFETCH_S``. If
a fetch fails the last good set stays in use.
"""

import json
import logging
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import jwt
from jwt import PyJWK, PyJWKSet

from cosyserve.server.auth.identity import AuthenticationError
from cosyserve.server.settings import SettingsError

logger = logging.getLogger(__name__)

_MIN_REFETCH_S = 10.0
_FETCH_TIMEOUT_S = 5.0
_MAX_JWKS_BYTES = 1024 * 1024
_LEEWAY_S = 5
# A fetched key set is used this long; a token with an unknown key id fetches it sooner.
JWKS_REFRESH_S = 300.0
# Asymmetric algorithms only: a JWKS publishes public keys, so HMAC (a shared secret) and
# "none" are never accepted.
JWT_ALGORITHMS = ["RS256", "ES256"]
_INVALID = "invalid or expired token"


def _is_url(source: str) -> bool:
    return source.startswith(("http://", "https://"))


class JwksCache:
    """The key set of ``source`` (an ``http(s)://`` URL or a file path), refreshed after
    ``refresh_s``. Blocking (network or file I/O): call from a thread."""

    def __init__(self, source: str, refresh_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.source = source
        self.refresh_s = refresh_s
        self._clock = clock
        self._keys: dict[str, PyJWK] = {}
        self._fetched_at: float | None = None
        self._tried_at: float | None = None
        self._lock = threading.Lock()
        if not _is_url(source):
            self._keys = self._read()  # a bad file is a start-up error
            self._fetched_at = clock()

    def _read(self) -> dict[str, PyJWK]:
        if _is_url(self.source):
            with urllib.request.urlopen(self.source, timeout=_FETCH_TIMEOUT_S) as response:
                text = response.read(_MAX_JWKS_BYTES + 1)
            if len(text) > _MAX_JWKS_BYTES:
                raise ValueError("the key set is larger than 1 MiB")
        else:
            try:
                text = Path(self.source).read_bytes()
            except OSError as exc:
                raise SettingsError(f"cannot read auth_jwks file {self.source}: {exc.strerror}") from None
        try:
            keys = PyJWKSet.from_dict(json.loads(text)).keys
        except (ValueError, jwt.PyJWKSetError, jwt.PyJWKError) as exc:
            raise SettingsError(f"auth_jwks {self.source} is not a usable JSON Web Key Set: {exc}") from None
        return {key.key_id or "": key for key in keys}

    def key(self, kid: str) -> PyJWK | None:
        """The key named ``kid``, fetching the set first when it is stale or lacks that key
        (a failed fetch is retried no sooner than ``_MIN_REFETCH_S`` later)."""
        with self._lock:
            now = self._clock()
            stale = self._fetched_at is None or now - self._fetched_at >= self.refresh_s
            if (stale or kid not in self._keys) and (
                self._tried_at is None or now - self._tried_at >= _MIN_REFETCH_S
            ):
                self._tried_at = now
                try:
                    self._keys = self._read()
                    self._fetched_at = now
                except (OSError, ValueError, SettingsError) as exc:
                    logger.warning("cannot fetch the JWT key set from %s: %s", self.source, exc)
            return self._keys.get(kid)


class JwtVerifier:
    """Checks bearer tokens; :meth:`verify` is blocking (it may fetch the key set)."""

    def __init__(self, keys: JwksCache, issuer: str, audience: str, algorithms: list[str]) -> None:
        self.keys = keys
        self.issuer = issuer
        self.audience = audience
        self.algorithms = algorithms

    def verify(self, token: str) -> str:
        """The token's subject; :class:`AuthenticationError` if it does not verify."""
        try:
            header = jwt.get_unverified_header(token)
        except jwt.InvalidTokenError:
            raise AuthenticationError(_INVALID) from None
        algorithm = header.get("alg")
        if algorithm not in self.algorithms:
            raise AuthenticationError(_INVALID)
        key = self.keys.key(str(header.get("kid") or ""))
        if key is None:
            raise AuthenticationError(_INVALID)
        try:
            claims = jwt.decode(
                token,
                key,
                algorithms=[algorithm],
                audience=self.audience,
                issuer=self.issuer,
                leeway=_LEEWAY_S,
                options={"require": ["exp", "iss", "aud", "sub"]},
            )
        except jwt.InvalidTokenError as exc:
            logger.debug("token refused: %s", type(exc).__name__)
            raise AuthenticationError(_INVALID) from None
        return str(claims["sub"])


def looks_like_jwt(token: str) -> bool:
    """Three base64url parts: a JWT rather than an API key."""
    return token.count(".") == 2
