"""What routes get from the app: the process's runtime and its models' speech services."""

from fastapi import Request

from cosyserve.server.runtime import ServerRuntime
from cosyserve.server.service import SpeechService


def runtime_of(request: Request) -> ServerRuntime:
    runtime: ServerRuntime = request.app.state.runtime
    return runtime


def service_of(request: Request, model: str | None = None) -> SpeechService:
    """The speech service of ``model`` (None: the default model), or 503 while the server
    is starting, draining or stopped; 404 ``model_not_found`` for a model not served
    (:meth:`~cosyserve.server.runtime.ServerRuntime.require_service`)."""
    return runtime_of(request).require_service(model)
