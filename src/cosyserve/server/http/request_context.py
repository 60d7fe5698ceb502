"""Per-request context of the HTTP server: request id, summary line, request metrics.

:class:`RequestContextMiddleware` (pure ASGI, so streamed bodies pass untouched) takes
the id from the ``X-Request-ID`` header (or makes one), returns it in the response
header, tags every log line made while handling the request with it
(:func:`cosyserve.logging_setup.request_scope`), and when the response has been sent
writes one summary line and records the request in
:class:`~cosyserve.server.observability.metrics.ServerMetrics`.

What the summary tells beyond route and status (voice, characters, audio seconds, time
to first audio) comes from the speech service, which fills the :class:`RequestRecord`
that :func:`current_record` returns. The text itself is never logged unless
``log_text_chars`` > 0, and then only its first ``log_text_chars`` characters.
"""

from __future__ import annotations

import contextvars
import logging
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cosyserve.logging_setup import request_scope
from cosyserve.server.observability import tracing

if TYPE_CHECKING:  # the service imports this module, and imports no web library
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    from cosyserve.server.observability.metrics import ServerMetrics

logger = logging.getLogger(__name__)

HEADER = "x-request-id"
# A client's id is echoed into headers and logs: keep it short and printable.
_VALID_ID = re.compile(r"^[\w.:/@+=\-]{1,128}$")
_RECORD: contextvars.ContextVar[RequestRecord | None] = contextvars.ContextVar(
    "cosyserve_request_record", default=None
)


@dataclass
class RequestRecord:
    """What one HTTP request did; the service fills the synthesis fields."""

    request_id: str
    route: str
    started: float = field(default_factory=time.perf_counter)
    voice: str | None = None
    model: str | None = None  # the id of the model that synthesised
    text: str | None = None
    characters: int = 0
    audio_s: float = 0.0
    first_audio_s: float | None = None
    error: str | None = None

    def add_audio(self, samples: int, sample_rate: int) -> None:
        """Count a chunk of audio (the first one sets the time to first audio)."""
        if samples and self.first_audio_s is None:
            self.first_audio_s = time.perf_counter() - self.started
        self.audio_s += samples / sample_rate


def current_record() -> RequestRecord | None:
    """The record of the HTTP request being handled, or None (gRPC, warm-up, tests)."""
    return _RECORD.get()


def new_request_id(given: str | None) -> str:
    """``given`` if it is a sane id, else a fresh one."""
    if given and _VALID_ID.fullmatch(given):
        return given
    return uuid.uuid4().hex


class RequestContextMiddleware:
    """See the module docstring. ``log_text_chars``: characters of the text to log."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, log_text_chars: int = 0) -> None:
        self.app = app
        self.metrics = metrics
        self.log_text_chars = log_text_chars

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        given = next((v.decode("latin-1") for k, v in scope["headers"] if k == HEADER.encode()), None)
        record = RequestRecord(new_request_id(given), route=scope["path"])
        status = 0

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != HEADER.encode()]
                headers.append((HEADER.encode(), record.request_id.encode()))
                message = {**message, "headers": headers}
            elif message["type"] == "websocket.accept":
                status = 101
            await send(message)

        token = _RECORD.set(record)
        try:
            with request_scope(record.request_id), tracing.span("http.request", path=scope["path"]):
                try:
                    await self.app(scope, receive, send_with_id)
                except BaseException:
                    status = status or 500
                    raise
                finally:
                    record.route = _route_of(scope)
                    self._finish(record, status, scope.get("method", "WS"))
        finally:
            _RECORD.reset(token)

    def _finish(self, record: RequestRecord, status: int, method: str) -> None:
        total_s = time.perf_counter() - record.started
        self.metrics.observe_request(
            route=record.route,
            status=status,
            total_s=total_s,
            first_audio_s=record.first_audio_s,
            audio_s=record.audio_s,
            model=record.model,
        )
        if record.route in _QUIET_ROUTES and status < 400:
            return  # probes and scrapes would drown the log
        summary: dict[str, Any] = {
            "method": method,
            "route": record.route,
            "status": status,
            "duration_s": round(total_s, 4),
        }
        if record.voice is not None or record.characters:
            summary.update(
                model=record.model,
                voice=record.voice,
                characters=record.characters,
                audio_s=round(record.audio_s, 3),
                first_audio_s=None if record.first_audio_s is None else round(record.first_audio_s, 4),
                rtf=round(total_s / record.audio_s, 4) if record.audio_s else None,
            )
        if record.error is not None:
            summary["error"] = record.error
        if self.log_text_chars and record.text:
            summary["text"] = record.text[: self.log_text_chars]
        logger.info("request done", extra=summary)


_QUIET_ROUTES = frozenset({"/health", "/ready", "/metrics"})


def _route_of(scope: Scope) -> str:
    """The matched route's path template (``/v1/voices/{name}``), never the raw path:
    raw paths would make one metric label per voice name or typo."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else "unmatched"
