"""The HTTP app factory: ``create_app(settings)`` builds a FastAPI app with no module state.

The lifespan starts the :class:`~cosyserve.server.runtime.ServerRuntime` in the background
(model directory check and audio cache, :mod:`~cosyserve.server.preflight`; then model
loading while the files are hashed, engine thread, voice store, warm-up), so ``/health``
answers at once and ``/ready`` turns 200 when synthesis is possible. Routes, wire models
and the services live in their own modules; routes reach a model's service through
the runtime (``request.app.state.runtime``, :mod:`~cosyserve.server.http.deps`).
"""

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import AsyncIterator, Callable
from functools import partial

from fastapi import FastAPI

from cosyserve.errors import CosyserveError
from cosyserve.server import preflight
from cosyserve.server.auth.access import AccessControl
from cosyserve.server.auth.grpc import AuthInterceptor
from cosyserve.server.auth.http import AuthMiddleware
from cosyserve.server.guard import InputGuard
from cosyserve.server.http.body_limit import BodySizeLimit
from cosyserve.server.http.errors import install_error_handlers
from cosyserve.server.http.request_context import RequestContextMiddleware
from cosyserve.server.http.routes import health, openai, playground, tts, upstream, voices, ws
from cosyserve.server.observability.metrics import ServerMetrics
from cosyserve.server.observability.metrics import router as metrics_router
from cosyserve.server.observability.watchdog import MemoryWatchdog, WatchdogConfig
from cosyserve.server.runtime import Phase, ServerRuntime
from cosyserve.server.settings import Settings

logger = logging.getLogger(__name__)

CUDA_ALLOC_CONF = "expandable_segments:True"


def create_app(settings: Settings, on_fatal: Callable[[], None] | None = None) -> FastAPI:
    """The HTTP app of one server process. ``on_fatal`` is called if the start fails
    (model cannot load, ...); without it the process stays up and ``/ready`` says failed."""
    # The playground's files load without a credential; its API calls carry one.
    access = AccessControl.from_settings(settings, pages=playground.PAGE_PATHS)
    guard = InputGuard.from_settings(settings)
    _apply_cuda_alloc_conf()
    metrics = ServerMetrics(lambda: runtime.services)
    runtime = ServerRuntime(settings, on_fatal, guard, (AuthInterceptor(access),))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async def start() -> None:
            try:
                prepared = await asyncio.to_thread(preflight.prepare, settings)
            except (CosyserveError, OSError) as exc:
                logger.error("server start failed: %s", exc)
                runtime.phase = Phase.FAILED
                if on_fatal is not None:
                    on_fatal()
                return
            await runtime.start(prepared.fingerprints, partial(preflight.verify, settings))
            if runtime.plan is not None:
                metrics.plan.info(runtime.plan.labels())
            for service in runtime.services:
                service.audio_cache = prepared.audio_cache
            app.state.service = runtime.service if runtime.ready else None

        starting = asyncio.create_task(start(), name="cosyserve-start")
        watching = _start_watchdog(metrics, runtime)
        reloads = _reload_on_sighup(guard, runtime)
        try:
            yield
        finally:
            reloads()
            app.state.service = None
            watching.cancel()
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            await runtime.stop()

    app = FastAPI(
        title="cosyserve",
        summary="CosyVoice 2 and 3 speech synthesis: OpenAI-compatible API, streaming, voices.",
        lifespan=lifespan,
    )
    app.state.runtime = runtime
    app.state.service = None
    app.state.metrics = metrics
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_upload_bytes)
    app.add_middleware(AuthMiddleware, access=access)  # outside the body limit: refuse before reading
    app.include_router(health.router)
    app.include_router(openai.router)
    app.include_router(tts.router)
    app.include_router(upstream.router)
    app.include_router(voices.router)
    app.include_router(ws.router)
    app.include_router(playground.router)
    app.include_router(metrics_router)
    # Outermost: every response (errors from inner middleware included) gets the request id.
    app.add_middleware(RequestContextMiddleware, metrics=metrics, log_text_chars=settings.log_text_chars)
    return app


def _reload_on_sighup(guard: InputGuard, runtime: ServerRuntime) -> Callable[[], None]:
    """Reload the sensitive-word list and the pronunciation dictionary on SIGHUP; returns
    the undo. Only the main thread can own signals (an app run by a test client in another
    thread does without)."""
    loop = asyncio.get_running_loop()

    def reload() -> None:
        loop.run_in_executor(None, guard.reload)
        loop.run_in_executor(None, runtime.reload_pronunciations)

    try:
        loop.add_signal_handler(signal.SIGHUP, reload)
    except (RuntimeError, ValueError, NotImplementedError):
        logger.debug("no SIGHUP handler here (not the main thread)")
        return lambda: None

    def undo() -> None:
        loop.remove_signal_handler(signal.SIGHUP)

    return undo


def _apply_cuda_alloc_conf() -> None:
    """Set the CUDA allocator's configuration before anything initialises CUDA: expandable
    segments, so that streams of changing lengths do not fragment GPU memory. An operator's
    own PYTORCH_CUDA_ALLOC_CONF wins."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", CUDA_ALLOC_CONF)


def _start_watchdog(metrics: ServerMetrics, runtime: ServerRuntime) -> "asyncio.Task[None]":
    """The memory watchdog task, with its default sampling (every 30 s while idle)."""
    config = WatchdogConfig()

    def idle() -> bool:
        services = runtime.services
        return bool(services) and all(service.in_flight == 0 for service in services)

    watchdog = MemoryWatchdog(config, metrics, idle)
    return asyncio.create_task(watchdog.run(), name="cosyserve-memory-watchdog")
