"""Access control as the transports apply it: authenticate, authorize, rate-limit.

:class:`AccessControl` is built once per process from the settings and shared by the
HTTP/WebSocket middleware and the gRPC interceptor, so both see the same identities and
the same per-identity buckets.
"""

import ipaddress
import logging
from dataclasses import dataclass, field

from cosyserve.server.auth.authenticator import Authenticator
from cosyserve.server.auth.identity import AuthenticationError, Credentials, ForbiddenError, Identity
from cosyserve.server.auth.ratelimit import FailureThrottle, RateLimiter, UsageMeter
from cosyserve.server.settings import Settings

logger = logging.getLogger(__name__)

# Probes stay open: orchestrators call them without credentials.
ALWAYS_OPEN = frozenset({"/health", "/ready"})
METRICS_PATH = "/metrics"


@dataclass(frozen=True)
class AccessControl:
    """``open_paths``: HTTP paths served without credentials or rate limits.
    ``voice_admins``: identities that may add and delete voices (empty: everyone
    authenticated). ``failures``: the per-address limit of failed authentications."""

    authenticator: Authenticator
    limiter: RateLimiter
    open_paths: frozenset[str] = ALWAYS_OPEN
    voice_admins: frozenset[str] = frozenset()
    failures: FailureThrottle = field(default_factory=lambda: FailureThrottle(0))

    @classmethod
    def from_settings(cls, settings: Settings, pages: frozenset[str] = frozenset()) -> "AccessControl":
        """``pages``: the app's paths that hold no secrets (the playground's files), open
        like the probes."""
        authenticator = Authenticator.from_settings(settings)
        if not authenticator.enabled and not _is_loopback(settings.host):
            logger.warning(
                "authentication is off (auth_mode = none) and the server listens on %s: "
                "anyone who can reach it can use it",
                settings.host,
            )
        open_paths = ALWAYS_OPEN | pages | (frozenset() if settings.auth_metrics else {METRICS_PATH})
        admins = frozenset(v.strip() for v in settings.auth_voice_admins.split(",") if v.strip())
        return cls(
            authenticator,
            RateLimiter(settings.rate_limit_rpm, settings.rate_limit_audio_s),
            open_paths,
            admins,
            FailureThrottle(settings.auth_failures_per_min),
        )

    async def admit(self, credentials: Credentials, manages_voices: bool = False) -> UsageMeter:
        """Authenticate, authorize and take a request token; raises
        :class:`~cosyserve.server.auth.identity.AuthenticationError`, :class:`ForbiddenError`
        or :class:`~cosyserve.server.auth.identity.RateLimitedError`. Returns the meter
        that charges the request's audio to its identity."""
        self.failures.check(credentials.peer)
        try:
            identity = await self.authenticator.authenticate(credentials)
        except AuthenticationError:
            self.failures.failed(credentials.peer)
            raise
        if manages_voices and self.authenticator.enabled:
            self.authorize_voice_admin(identity)
        self.limiter.take_request(identity)
        return UsageMeter(self.limiter, identity)

    def authorize_voice_admin(self, identity: Identity) -> None:
        if self.voice_admins and identity.name not in self.voice_admins:
            raise ForbiddenError("this identity may not add or delete voices")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
