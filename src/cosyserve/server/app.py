"""The HTTP app factory: ``create_app(settings)`` builds a FastAPI app with no module state.

The lifespan starts the :class:`~cosyserve.server.runtime.ServerRuntime` in the background
(model directory check and audio cache, :mod:`~cosyserve.server.preflight`; then model
loading, engine thread, voice store, warm-up), so ``/health`` answers at once and
``/ready`` turns 200 when synthesis is possible. Routes, wire models and the service live
in their own modules; routes reach the service through ``request.app.state.service``.
"""

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI

from cosyserve.errors import CosyserveError
from cosyserve.server import (
    preflight,
    routes_health,
    routes_openai,
    routes_tts,
    routes_upstream,
    routes_voices,
    routes_ws,
)
from cosyserve.server.body_limit import BodySizeLimit
from cosyserve.server.http_errors import install_error_handlers
from cosyserve.server.runtime import Phase, ServerRuntime
from cosyserve.settings import Settings

logger = logging.getLogger(__name__)


def create_app(settings: Settings, on_fatal: Callable[[], None] | None = None) -> FastAPI:
    """The HTTP app of one server process. ``on_fatal`` is called if the start fails
    (model cannot load, ...); without it the process stays up and ``/ready`` says failed."""
    runtime = ServerRuntime(settings, on_fatal)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async def start() -> None:
            try:
                audio_cache = await asyncio.to_thread(preflight.prepare, settings)
            except (CosyserveError, OSError) as exc:
                logger.error("server start failed: %s", exc)
                runtime.phase = Phase.FAILED
                if on_fatal is not None:
                    on_fatal()
                return
            await runtime.start()
            if runtime.service is not None:
                runtime.service.audio_cache = audio_cache
            app.state.service = runtime.service if runtime.ready else None

        starting = asyncio.create_task(start(), name="cosyserve-start")
        try:
            yield
        finally:
            app.state.service = None
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            await runtime.stop()

    app = FastAPI(
        title="cosyserve",
        summary="CosyVoice 2 speech synthesis: OpenAI-compatible API, streaming, voices.",
        lifespan=lifespan,
    )
    app.state.runtime = runtime
    app.state.service = None
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_upload_bytes)
    app.include_router(routes_health.router)
    app.include_router(routes_openai.router)
    app.include_router(routes_tts.router)
    app.include_router(routes_upstream.router)
    app.include_router(routes_voices.router)
    app.include_router(routes_ws.router)
    return app
