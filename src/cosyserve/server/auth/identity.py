"""Who a request comes from, and the errors of access control."""

from dataclasses import dataclass

from cosyserve.errors import CosyserveError


@dataclass(frozen=True)
class Identity:
    """An authenticated caller. ``name``: the key's or user's name, the token's subject, or
    the gateway's header value (``anonymous@<address>`` when authentication is off).
    ``method``: ``api_key``, ``basic``, ``jwt``, ``gateway`` or ``none``."""

    name: str
    method: str


@dataclass(frozen=True)
class Credentials:
    """What a request presents: its ``Authorization`` value, the trusted gateway header's
    value, and the peer's IP address (None when unknown)."""

    authorization: str | None
    gateway_identity: str | None
    peer: str | None


class AuthenticationError(CosyserveError):
    """No credential, or one that is wrong, expired or not valid here (HTTP 401)."""

    code = "unauthorized"


class ForbiddenError(CosyserveError):
    """An authenticated caller that may not use this operation (HTTP 403)."""

    code = "forbidden"


class RateLimitedError(CosyserveError):
    """The caller used up its requests or audio seconds per minute (HTTP 429)."""

    code = "rate_limited"

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
