"""Authentication, authorization and per-identity rate limits for every transport.

:class:`~cosyserve.server.auth.access.AccessControl` (built from the settings) combines an
:class:`~cosyserve.server.auth.authenticator.Authenticator` (API keys, HTTP Basic, OIDC/JWT,
a trusted gateway header) with a :class:`~cosyserve.server.auth.ratelimit.RateLimiter`;
:mod:`~cosyserve.server.auth.http` applies it to HTTP and WebSocket requests and
:mod:`~cosyserve.server.auth.grpc` to gRPC calls, in the same way.
"""
