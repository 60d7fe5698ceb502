"""Running the app under uvicorn: one process, or N worker processes on one socket.

Shutdown is the same in both: SIGTERM (or Ctrl-C) marks the runtime draining (``/ready``
503, new requests 503), uvicorn closes the listeners and waits for open responses; after
``shutdown_grace_s`` the engine is stopped, which ends every request still running with
``engine_dead`` (a truncated stream, or a 503 where nothing was sent yet), and the
process exits. uvicorn's own task-cancelling timeout is only a backstop behind that.

Workers are spawned processes (not forks: the parent may have imported torch) sharing
the parent's listening socket; each loads the model (memory-mapped, so the weight pages
are shared) and runs its own engine. The parent forwards SIGTERM/SIGINT as SIGTERM and
SIGHUP as SIGHUP (reload the sensitive-word list). A worker that dies after it started
(killed by the OOM killer, a crash) is replaced; a worker whose start fails, or workers
that keep dying (more than ``_MAX_RESTARTS`` within ``_RESTART_WINDOW_S``), stop them all:
a configuration or model problem is not fixed by starting again.
"""

import asyncio
import logging
import math
import multiprocessing
import os
import signal
import socket
import time
from collections import deque
from multiprocessing.connection import wait
from multiprocessing.context import SpawnContext, SpawnProcess
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn

from cosyserve.errors import CosyserveError
from cosyserve.logging_setup import default_log_format, log_config
from cosyserve.server.settings import Settings

if TYPE_CHECKING:
    from cosyserve.server.runtime import ServerRuntime

logger = logging.getLogger(__name__)

# Seconds uvicorn waits beyond the grace period before cancelling response tasks itself.
_BACKSTOP_S = 5
# Exit status of a worker whose start failed (model could not load, ...).
_START_FAILED = 2
# More worker deaths than this within the window stop the server instead of restarting.
_MAX_RESTARTS = 5
_RESTART_WINDOW_S = 60.0


class ServerStartError(CosyserveError):
    code = "server_start_failed"


class Server(uvicorn.Server):
    """uvicorn's server, draining the runtime on shutdown and logging the bound address."""

    def __init__(self, config: uvicorn.Config, runtime: "ServerRuntime") -> None:
        super().__init__(config)
        self.runtime = runtime

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        for listener in self.servers:
            for sock in listener.sockets:
                address, port = sock.getsockname()[:2]
                logger.info("HTTP listening on http://%s:%d", address, port)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        # uvicorn re-raises the signal after shutting down; the drain is the whole answer
        # to it here, so the process exits normally (status 0, no KeyboardInterrupt).
        self._captured_signals.clear()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await self.runtime.drain()
        cut_off = asyncio.create_task(self.runtime.cut_off(self.runtime.settings.shutdown_grace_s))
        try:
            await super().shutdown(sockets)
        finally:
            cut_off.cancel()


def run(settings: Settings) -> None:
    """Serve until SIGTERM/SIGINT; raises :class:`ServerStartError` if the start fails."""
    if settings.workers == 1:
        if not _serve(settings, None):
            raise ServerStartError("the server could not start; see the log above")
        return
    config = _uvicorn_config(settings)
    sock = config.bind_socket()
    address, port = sock.getsockname()[:2]
    logger.info("HTTP listening on http://%s:%d (%d workers)", address, port, settings.workers)
    try:
        _supervise(settings, sock)
    finally:
        sock.close()


def _serve(settings: Settings, sock: socket.socket | None) -> bool:
    """Run one server process to its end; False if its start failed."""
    # Imported here: a workers' supervisor never loads the model stack (torch) itself.
    from cosyserve.server.http.app import create_app

    failed = False

    def on_fatal() -> None:
        nonlocal failed
        failed = True
        server.should_exit = True

    app = create_app(settings, on_fatal=on_fatal)
    server = Server(_uvicorn_config(settings, app), app.state.runtime)
    server.run(None if sock is None else [sock])
    return not failed


def _worker(env: dict[str, str], sock: socket.socket) -> None:
    """A worker process's entry point: settings come through the environment."""
    # SIGHUP's default action kills; the app replaces this with its reload handler once
    # it runs, and a worker still starting reads the files it needs anyway.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    os.environ.update(env)
    if not _serve(Settings.load(), sock):
        raise SystemExit(_START_FAILED)


def _supervise(settings: Settings, sock: socket.socket) -> None:
    env = settings.to_env()
    context = multiprocessing.get_context("spawn")
    workers = [_spawn(context, env, sock) for _ in range(settings.workers)]
    restarts: deque[float] = deque()
    stopping = False
    failure = ""

    def on_stop(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    def on_hangup(signum: int, frame: FrameType | None) -> None:
        for worker in workers:
            if worker.exitcode is None and worker.pid is not None:
                os.kill(worker.pid, signal.SIGHUP)

    handlers = {signal.SIGTERM: on_stop, signal.SIGINT: on_stop, signal.SIGHUP: on_hangup}
    previous = {sig: signal.signal(sig, handler) for sig, handler in handlers.items()}
    try:
        while not stopping and not failure:
            wait([w.sentinel for w in workers], timeout=0.5)
            for index, worker in enumerate(workers):
                if stopping or worker.exitcode is None:
                    continue
                failure = _restart_refusal(worker, restarts)
                if failure:
                    break
                logger.error("worker %d exited (status %s); starting a new one", worker.pid, worker.exitcode)
                workers[index] = _spawn(context, env, sock)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for worker in workers:
            if worker.exitcode is None and worker.pid is not None:
                os.kill(worker.pid, signal.SIGTERM)
        for worker in workers:
            worker.join(settings.shutdown_grace_s + 2 * _BACKSTOP_S)
            if worker.exitcode is None:
                worker.kill()
                worker.join()
    if failure:
        raise ServerStartError(f"{failure}; all workers stopped")


def _spawn(context: SpawnContext, env: dict[str, str], sock: socket.socket) -> SpawnProcess:
    worker = context.Process(target=_worker, args=(env, sock), daemon=False)
    worker.start()
    return worker


def _restart_refusal(worker: SpawnProcess, restarts: deque[float]) -> str:
    """Why ``worker``, which has exited, must not be replaced; empty if it may be.
    ``restarts`` holds the times of recent replacements and records this one."""
    if worker.exitcode == _START_FAILED:
        return f"a worker process could not start (status {worker.exitcode})"
    now = time.monotonic()
    while restarts and now - restarts[0] > _RESTART_WINDOW_S:
        restarts.popleft()
    if len(restarts) >= _MAX_RESTARTS:
        return f"worker processes exited {len(restarts) + 1} times within {_RESTART_WINDOW_S:.0f} s"
    restarts.append(now)
    return ""


def _uvicorn_config(settings: Settings, app: Any = None) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=log_config(settings.log_level, default_log_format()),
        access_log=False,  # the request summary line replaces it (no query strings: user text)
        log_level=settings.log_level,
        timeout_graceful_shutdown=math.ceil(settings.shutdown_grace_s) + _BACKSTOP_S,
    )
