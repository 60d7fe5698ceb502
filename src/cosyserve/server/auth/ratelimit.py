"""Per-identity rate limits: requests per minute and synthesized audio seconds per minute.

Each identity has two token buckets holding up to one minute's allowance and refilling
continuously. A request takes one request token up front; audio seconds are charged as
the audio is made, so a long synthesis may take the audio bucket below zero, and the
identity's next synthesis waits until it has refilled above zero. A refused request gets
:class:`RateLimitedError` with the seconds until it would pass (HTTP ``Retry-After``).
"""

import contextlib
import math
import threading
import time
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field

from cosyserve.server.auth.identity import Identity, RateLimitedError

# Buckets of identities idle this long are full again and can be dropped.
_IDLE_S = 120.0
_PRUNE_EVERY = 1024


@dataclass
class TokenBucket:
    """``capacity`` tokens at most, ``rate`` tokens per second back; ``level`` may go
    below zero (a debt) through :meth:`charge`."""

    capacity: float
    rate: float
    level: float
    updated: float

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = now

    def wait_s(self, need: float) -> float:
        """Seconds until ``level`` reaches ``need`` (0 if it already has)."""
        return 0.0 if self.level >= need else (need - self.level) / self.rate


@dataclass
class _Buckets:
    requests: TokenBucket | None
    audio: TokenBucket | None
    seen: float = field(default=0.0)


class RateLimiter:
    """``requests_per_min`` and ``audio_s_per_min`` per identity; 0 turns a limit off."""

    def __init__(
        self, requests_per_min: float, audio_s_per_min: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.requests_per_min = requests_per_min
        self.audio_s_per_min = audio_s_per_min
        self._clock = clock
        self._buckets: dict[str, _Buckets] = {}
        self._lock = threading.Lock()
        self._calls = 0

    @property
    def enabled(self) -> bool:
        return self.requests_per_min > 0 or self.audio_s_per_min > 0

    def _get(self, identity: Identity, now: float) -> _Buckets:
        self._calls += 1
        if self._calls % _PRUNE_EVERY == 0:
            self._buckets = {k: b for k, b in self._buckets.items() if now - b.seen < _IDLE_S}
        buckets = self._buckets.get(identity.name)
        if buckets is None:

            def bucket(per_min: float) -> TokenBucket | None:
                return TokenBucket(per_min, per_min / 60.0, per_min, now) if per_min > 0 else None

            buckets = _Buckets(bucket(self.requests_per_min), bucket(self.audio_s_per_min))
            self._buckets[identity.name] = buckets
        buckets.seen = now
        for b in (buckets.requests, buckets.audio):
            if b is not None:
                b.refill(now)
        return buckets

    def take_request(self, identity: Identity, spend: bool = True) -> None:
        """Spend one request token (or, with ``spend`` False, only check that there is one),
        or raise :class:`RateLimitedError`."""
        if not self.enabled:
            return
        with self._lock:
            buckets = self._get(identity, self._clock())
            requests = buckets.requests
            if requests is not None:
                if requests.level < 1:
                    raise RateLimitedError(
                        f"more than {self.requests_per_min:g} requests per minute; retry later",
                        _retry_after(requests.wait_s(1)),
                    )
                requests.level -= 1 if spend else 0

    def check_audio(self, identity: Identity) -> None:
        """Raise :class:`RateLimitedError` while the identity's audio allowance is used up."""
        if self.audio_s_per_min <= 0:
            return
        with self._lock:
            audio = self._get(identity, self._clock()).audio
            if audio is not None and audio.level <= 0:
                raise RateLimitedError(
                    f"more than {self.audio_s_per_min:g} seconds of audio per minute; retry later",
                    _retry_after(audio.wait_s(1e-3)),
                )

    def charge_audio(self, identity: Identity, seconds: float) -> None:
        """Record ``seconds`` of audio made for the identity (may leave a debt)."""
        if self.audio_s_per_min <= 0:
            return
        with self._lock:
            audio = self._get(identity, self._clock()).audio
            if audio is not None:
                audio.level -= seconds


class FailureThrottle:
    """At most ``per_min`` failed authentications per minute per client address (a token
    bucket each): past that, the address is refused before its credential is checked, so
    guessing keys or passwords, or burning the server's CPU on slow hashes, is bounded."""

    def __init__(self, per_min: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._limiter = RateLimiter(per_min, 0, clock)

    def check(self, peer: str | None) -> None:
        """Raise :class:`RateLimitedError` while ``peer`` has no failures left."""
        try:
            self._limiter.take_request(_peer(peer), spend=False)
        except RateLimitedError as exc:
            raise RateLimitedError(
                "too many failed authentications; retry later", exc.retry_after_s
            ) from None

    def failed(self, peer: str | None) -> None:
        with contextlib.suppress(RateLimitedError):
            self._limiter.take_request(_peer(peer))


def _peer(peer: str | None) -> Identity:
    return Identity(f"peer:{peer or 'unknown'}", "none")


def _retry_after(seconds: float) -> int:
    return max(1, math.ceil(seconds))


@dataclass(frozen=True)
class UsageMeter:
    """The audio account of the current request's identity (see :data:`current_usage`)."""

    limiter: RateLimiter
    identity: Identity

    def check(self) -> None:
        self.limiter.check_audio(self.identity)

    def charge(self, seconds: float) -> None:
        self.limiter.charge_audio(self.identity, seconds)


# Set by the HTTP middleware and the gRPC interceptor for the duration of a request, so
# that the service charges the audio it makes to the caller without every transport
# passing the identity through. A context variable is a key, not shared state: each
# request's task sees its own value.
current_usage: ContextVar[UsageMeter | None] = ContextVar("cosyserve_usage", default=None)
