"""One authenticator over the configured methods: a request's credentials -> an Identity.

Order: a trusted gateway's identity header (only from the gateway's addresses), then the
``Authorization`` header: ``Bearer <JWT>`` (three dot-separated parts, when a key set is
configured), ``Bearer <API key>``, or ``Basic <user:password>``. Every failure is the same
:class:`AuthenticationError` ("missing" or "invalid" credentials), whatever the method, so
a client learns nothing about which keys, users or token fields exist.
"""

import asyncio
import logging
from pathlib import Path

from cosyserve.server.auth.basic import BasicUsers, parse_basic
from cosyserve.server.auth.gateway import Gateway
from cosyserve.server.auth.identity import AuthenticationError, Credentials, Identity
from cosyserve.server.auth.jwt import JWKS_REFRESH_S, JWT_ALGORITHMS, JwksCache, JwtVerifier, looks_like_jwt
from cosyserve.server.auth.keys import ApiKeys, parse_entries
from cosyserve.server.settings import Settings, SettingsError

logger = logging.getLogger(__name__)

_MISSING = "authentication required: send Authorization: Bearer <API key or token>, or Basic"
_INVALID = "invalid credentials"


def _split(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _entries(value: str, what: str) -> str:
    """``value``'s entries one a line: comma-separated, or ``@FILE``'s lines."""
    if not value.startswith("@"):
        return value.replace(",", "\n")
    try:
        return Path(value[1:]).read_text(encoding="utf-8")
    except OSError as exc:
        raise SettingsError(f"cannot read {what} file {value[1:]}: {exc.strerror}") from None


class Authenticator:
    """``enabled`` False (``auth_mode = "none"``): everyone is ``anonymous@<address>``."""

    def __init__(
        self,
        *,
        enabled: bool = True,
        api_keys: ApiKeys | None = None,
        basic: BasicUsers | None = None,
        jwt: JwtVerifier | None = None,
        gateway: Gateway | None = None,
    ) -> None:
        self.enabled = enabled
        self.api_keys = api_keys if api_keys else None
        self.basic = basic if basic else None
        self.jwt = jwt
        self.gateway = gateway
        if enabled and not (self.api_keys or self.basic or self.jwt or self.gateway):
            raise SettingsError(
                "authentication is on but no method is configured: set auth_api_keys, "
                'auth_basic_users, auth_jwks or auth_gateway_*, or auth_mode = "none"'
            )

    @classmethod
    def from_settings(cls, settings: Settings) -> "Authenticator":
        if settings.auth_mode == "none":
            return cls(enabled=False)
        keys = parse_entries(_entries(settings.auth_api_keys, "auth_api_keys"), "auth_api_keys")
        users = parse_entries(_entries(settings.auth_basic_users, "auth_basic_users"), "auth_basic_users")
        verifier = None
        if settings.auth_jwks:
            if not settings.auth_jwt_issuer or not settings.auth_jwt_audience:
                raise SettingsError("auth_jwks needs auth_jwt_issuer and auth_jwt_audience")
            verifier = JwtVerifier(
                JwksCache(settings.auth_jwks, JWKS_REFRESH_S),
                settings.auth_jwt_issuer,
                settings.auth_jwt_audience,
                JWT_ALGORITHMS,
            )
        gateway = None
        if settings.auth_gateway_header or settings.auth_gateway_trusted:
            gateway = Gateway(settings.auth_gateway_header, _split(settings.auth_gateway_trusted))
        return cls(
            api_keys=ApiKeys(keys) if keys else None,
            basic=BasicUsers(users) if users else None,
            jwt=verifier,
            gateway=gateway,
        )

    @property
    def gateway_header(self) -> str | None:
        return None if self.gateway is None else self.gateway.header

    async def authenticate(self, credentials: Credentials) -> Identity:
        """The caller's identity, or :class:`AuthenticationError`. Hash checks and key-set
        fetches run in a worker thread, off the event loop."""
        if not self.enabled:
            return Identity(f"anonymous@{credentials.peer or 'unknown'}", "none")
        if self.gateway is not None:
            name = self.gateway.identity(credentials.gateway_identity, credentials.peer)
            if name is not None:
                return Identity(name, "gateway")
        if not credentials.authorization:
            raise AuthenticationError(_MISSING)
        scheme, _, value = credentials.authorization.strip().partition(" ")
        scheme, value = scheme.lower(), value.strip()
        if scheme == "bearer" and value:
            if self.jwt is not None and looks_like_jwt(value):
                return Identity(await asyncio.to_thread(self.jwt.verify, value), "jwt")
            if self.api_keys is not None:
                name = await asyncio.to_thread(self.api_keys.verify, value)
                if name is not None:
                    return Identity(name, "api_key")
        elif scheme == "basic" and self.basic is not None:
            pair = parse_basic(value)
            if pair is not None:
                name = await asyncio.to_thread(self.basic.verify, *pair)
                if name is not None:
                    return Identity(name, "basic")
        raise AuthenticationError(_INVALID)
