"""What routes get from the app: the process's runtime and its speech service."""

from fastapi import Request

from cosyserve.server.runtime import ServerRuntime
from cosyserve.server.service import SpeechService


def runtime_of(request: Request) -> ServerRuntime:
    runtime: ServerRuntime = request.app.state.runtime
    return runtime


def service_of(request: Request) -> SpeechService:
    """The speech service (``request.app.state.service``), or 503 while the server is
    starting, draining or stopped."""
    return runtime_of(request).require_service()
