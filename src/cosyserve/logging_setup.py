"""Log records as JSON lines or human-readable text, each with its request id.

Only entry points configure logging: the CLI's callback, and the server through
:func:`log_config` (uvicorn applies it in every server process, workers included). Any
module may *tag* its log lines with a request: :func:`request_scope` sets the id that
:class:`RequestIdFilter` adds to every record made in that context (the HTTP middleware
sets it per request; the engine thread per piece of request work).
"""

import contextlib
import contextvars
import json
import logging
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any, Literal

LogFormat = Literal["json", "text"]

# The request whose work the current context does ("" outside any request).
_REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("cosyserve_request_id", default="")

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"
# LogRecord attributes that are not extra fields given with ``extra=``.
_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {
    "message",
    "asctime",
    "request_id",
    "taskName",
    "color_message",  # uvicorn's ANSI-coloured copy of the message
}


def current_request_id() -> str:
    return _REQUEST_ID.get()


@contextlib.contextmanager
def request_scope(request_id: str) -> Iterator[None]:
    """Tag the log records made inside the ``with`` body with ``request_id``."""
    token = _REQUEST_ID.set(request_id)
    try:
        yield
    finally:
        _REQUEST_ID.reset(token)


class RequestIdFilter(logging.Filter):
    """Adds ``record.request_id`` (the context's, or "-" outside a request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "request_id", ""):
            record.request_id = _REQUEST_ID.get() or "-"
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts``, ``level``, ``logger``, ``msg``, ``request_id``
    (when inside a request), fields given with ``extra=``, and ``exc`` (the traceback)."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        request_id = getattr(record, "request_id", "-")
        if request_id and request_id != "-":
            entry["request_id"] = request_id
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    """:data:`TEXT_FORMAT`, followed by the ``extra=`` fields as ``key=value``."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        if not hasattr(record, "request_id"):
            record.request_id = "-"
        line = super().format(record)
        extra = [
            f"{k}={v}" for k, v in record.__dict__.items() if k not in _STANDARD and not k.startswith("_")
        ]
        if not extra:
            return line
        head, newline, rest = line.partition("\n")  # keep a traceback below the fields
        return f"{head} {' '.join(extra)}{newline}{rest}"


def default_log_format() -> LogFormat:
    """Lines for a person at a terminal, JSON objects for everything else (a container's
    log collector, a file, a pipe)."""
    return "text" if sys.stderr.isatty() else "json"


def log_config(level: str, fmt: LogFormat) -> dict[str, Any]:
    """A :func:`logging.config.dictConfig` dict: one stderr handler on the root logger
    (uvicorn's loggers propagate to it); uvicorn's access log is off, as the request
    summary line replaces it and an access line would show query strings (user text)."""
    formatter = f"{__name__}.JsonFormatter" if fmt == "json" else f"{__name__}.TextFormatter"
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"request_id": {"()": f"{__name__}.RequestIdFilter"}},
        "formatters": {"main": {"()": formatter}},
        "handlers": {
            "stderr": {"class": "logging.StreamHandler", "formatter": "main", "filters": ["request_id"]}
        },
        "root": {"handlers": ["stderr"], "level": level.upper()},
        "loggers": {
            "uvicorn": {"handlers": [], "propagate": True},
            "uvicorn.error": {"handlers": [], "propagate": True},
            "uvicorn.access": {"handlers": [], "propagate": False, "level": "CRITICAL"},
        },
    }


def configure(level: str, fmt: LogFormat) -> None:
    """Apply :func:`log_config` to this process (the CLI's entry point)."""
    import logging.config

    logging.config.dictConfig(log_config(level, fmt))
