"""The one table from cosyserve errors to transport status codes (HTTP and gRPC).

Every transport asks :func:`map_error` what to tell a client about an exception. Errors
cosyserve raises on purpose (:class:`~cosyserve.errors.CosyserveError`) carry a stable
``code`` and a message written for users; client-caused and capacity errors show that
message. Server-side failures (a bug, a broken model, an engine failure) show a generic
message only: their text can name files, tensors or internals and goes to the log instead.

HTTP error bodies use OpenAI's shape on every route, ``{"error": {"message", "type",
"param", "code"}}``, so one client-side parser handles all of cosyserve's endpoints.
"""

import logging
from dataclasses import dataclass
from typing import Any

import grpc

from cosyserve.engine.admission import OverloadedError
from cosyserve.engine.async_engine import EngineDeadError
from cosyserve.engine.engine import DeviceOutOfMemoryError
from cosyserve.errors import CosyserveError, InvalidRequestError
from cosyserve.models.kv_cache import CacheFullError
from cosyserve.pipeline.frontend import UnknownSpeakerError
from cosyserve.pipeline.voice import VoiceExistsError
from cosyserve.server.auth.identity import AuthenticationError, ForbiddenError, RateLimitedError
from cosyserve.server.service import DeadlineExceededError
from cosyserve.voices.store import VoiceStoreUnavailableError

logger = logging.getLogger(__name__)

GENERIC_MESSAGE = "internal server error"


class PayloadTooLargeError(InvalidRequestError):
    """A request body (upload, JSON) is larger than the server accepts."""

    code = "payload_too_large"


class NotReadyError(CosyserveError):
    """The server is starting (model loading, warm-up) or shutting down."""

    code = "not_ready"


class ModelNotFoundError(CosyserveError):
    """The request names a model this server does not serve (several are served)."""

    code = "model_not_found"


@dataclass(frozen=True)
class MappedError:
    """What a client is told about one error.

    ``http_status``/``grpc_status``: the status codes. ``code``: the stable
    machine-readable identifier. ``message``: safe to show. ``type``: the OpenAI error
    ``type``. ``retry_after_s``: set for capacity errors (HTTP ``Retry-After``).
    ``param``: the request field at fault, when known.
    """

    http_status: int
    grpc_status: grpc.StatusCode
    code: str
    message: str
    type: str
    retry_after_s: int | None = None
    param: str | None = None

    @property
    def server_side(self) -> bool:
        return self.http_status >= 500

    def openai_body(self) -> dict[str, Any]:
        """The JSON body of an HTTP error response (OpenAI's error shape)."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def http_headers(self) -> dict[str, str]:
        return {} if self.retry_after_s is None else {"Retry-After": str(self.retry_after_s)}


@dataclass(frozen=True)
class _Rule:
    http_status: int
    grpc_status: grpc.StatusCode
    type: str
    retry: bool = False


# Most specific first: the first class the error is an instance of decides.
_RULES: tuple[tuple[type[CosyserveError], _Rule], ...] = (
    (UnknownSpeakerError, _Rule(404, grpc.StatusCode.NOT_FOUND, "not_found_error")),
    # OpenAI's answer to an unknown model: 404, an invalid request.
    (ModelNotFoundError, _Rule(404, grpc.StatusCode.NOT_FOUND, "invalid_request_error")),
    (VoiceExistsError, _Rule(409, grpc.StatusCode.ALREADY_EXISTS, "invalid_request_error")),
    (AuthenticationError, _Rule(401, grpc.StatusCode.UNAUTHENTICATED, "authentication_error")),
    (ForbiddenError, _Rule(403, grpc.StatusCode.PERMISSION_DENIED, "permission_error")),
    (RateLimitedError, _Rule(429, grpc.StatusCode.RESOURCE_EXHAUSTED, "rate_limit_error", retry=True)),
    (PayloadTooLargeError, _Rule(413, grpc.StatusCode.INVALID_ARGUMENT, "invalid_request_error")),
    (InvalidRequestError, _Rule(400, grpc.StatusCode.INVALID_ARGUMENT, "invalid_request_error")),
    (OverloadedError, _Rule(429, grpc.StatusCode.RESOURCE_EXHAUSTED, "rate_limit_error", retry=True)),
    (CacheFullError, _Rule(429, grpc.StatusCode.RESOURCE_EXHAUSTED, "rate_limit_error", retry=True)),
    (DeadlineExceededError, _Rule(504, grpc.StatusCode.DEADLINE_EXCEEDED, "timeout_error")),
    (EngineDeadError, _Rule(503, grpc.StatusCode.UNAVAILABLE, "server_error", retry=True)),
    (DeviceOutOfMemoryError, _Rule(503, grpc.StatusCode.UNAVAILABLE, "server_error", retry=True)),
    (NotReadyError, _Rule(503, grpc.StatusCode.UNAVAILABLE, "server_error", retry=True)),
    (VoiceStoreUnavailableError, _Rule(503, grpc.StatusCode.UNAVAILABLE, "server_error", retry=True)),
)
_INTERNAL = _Rule(500, grpc.StatusCode.INTERNAL, "server_error")


def map_error(
    exc: BaseException, retry_after_s: int = 1, param: str | None = None, *, log: bool = True
) -> MappedError:
    """What to tell a client about ``exc``. Server-side errors are logged here (with their
    traceback unless cosyserve raised them on purpose), so callers need not log again;
    ``log=False`` where the caller's framework logs the traceback itself."""
    rule = _INTERNAL
    if isinstance(exc, CosyserveError):
        rule = next((r for cls, r in _RULES if isinstance(exc, cls)), _INTERNAL)
    if rule is _INTERNAL:
        if log and isinstance(exc, CosyserveError):
            logger.error("request failed: %s: %s", exc.code, exc)
        elif log:
            logger.error("request failed with an unexpected error", exc_info=exc)
        return MappedError(rule.http_status, rule.grpc_status, "internal_error", GENERIC_MESSAGE, rule.type)
    assert isinstance(exc, CosyserveError)  # only CosyserveError subclasses have rules
    if isinstance(exc, RateLimitedError):  # the limiter knows when the caller may retry
        retry_after_s = exc.retry_after_s
    return MappedError(
        http_status=rule.http_status,
        grpc_status=rule.grpc_status,
        code=exc.code,
        message=str(exc) or exc.code,
        type=rule.type,
        retry_after_s=retry_after_s if rule.retry else None,
        param=param,
    )


def validation_error(message: str, param: str | None = None) -> MappedError:
    """A request that does not match the wire schema (HTTP 422, like FastAPI's default)."""
    return MappedError(
        422,
        grpc.StatusCode.INVALID_ARGUMENT,
        "invalid_request",
        message,
        "invalid_request_error",
        param=param,
    )


def http_error(status: int, message: str) -> MappedError:
    """A routing-level HTTP error (404 no such route, 405 method not allowed, ...)."""
    grpc_status = grpc.StatusCode.NOT_FOUND if status == 404 else grpc.StatusCode.INVALID_ARGUMENT
    kind = "not_found_error" if status == 404 else "invalid_request_error"
    code = {404: "not_found", 405: "method_not_allowed"}.get(status, "http_error")
    if status >= 500:
        return MappedError(
            status, grpc.StatusCode.INTERNAL, "internal_error", GENERIC_MESSAGE, "server_error"
        )
    return MappedError(status, grpc_status, code, message, kind)
