"""The Ray Serve application: ``serve run cosyserve.deploy.ray:build_app model_dir=DIR ...``.

Each replica is one process with one engine, running the same HTTP app as ``cosyserve
serve`` (:func:`~cosyserve.server.http.app.create_app`: OpenAI speech, ``/tts``,
upstream's endpoints, voices, the WebSocket) behind Ray Serve's proxy, which streams
responses and WebSockets through. A replica counts as started once its model is loaded
and warmed up, and its health check fails while its engine cannot synthesise, so Ray
replaces it. Replicas on several machines share registered voices through a PostgreSQL
``voices_db``. The arguments are in :mod:`cosyserve.deploy.ray_args`.
"""

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from fastapi import FastAPI

from cosyserve import logging_setup
from cosyserve.deploy.ray_args import plan_ray_app
from cosyserve.deploy.replica_header import NODE_HEADER, REPLICA_HEADER, ReplicaHeaders
from cosyserve.parallelism import pin_torch_threads
from cosyserve.server.http.app import create_app
from cosyserve.server.runtime import Phase, ServerRuntime
from cosyserve.server.settings import Settings

try:
    import ray
    from ray import serve
    from ray.serve import Application
except ImportError as exc:  # an optional extra
    raise ImportError(
        "cosyserve.deploy.ray needs Ray Serve: pip install 'cosyserve[ray]' (ray[serve] 2.60)"
    ) from exc

DEPLOYMENT_NAME = "cosyserve"
# How often a starting replica looks whether its model has loaded.
_START_POLL_S = 0.1

Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[Any]]


class ReplicaNotReadyError(RuntimeError):
    """The replica's engine cannot synthesise (failed start, dead engine thread)."""


class SpeechReplica:
    """One replica: one engine and the HTTP app in front of it (the deployment's class,
    which :func:`build_app` wraps in Ray's ingress)."""

    def __init__(self, settings: dict[str, Any], threads: int) -> None:
        # Before the runtime starts: the engine's thread takes this thread's count.
        pin_torch_threads(threads)
        self._settings = Settings(**settings)
        # A replica is a process of its own: its entry point configures its logging (JSON
        # lines on stderr, which Ray keeps in the node's worker logs).
        logging_setup.configure(self._settings.log_level, "json")
        self._runtime: ServerRuntime | None = None

    def __serve_build_asgi_app__(self) -> FastAPI:
        """Ray's hook for an app made inside the replica (the model cannot travel)."""
        app = create_app(self._settings)
        runtime: ServerRuntime = app.state.runtime
        self._runtime = runtime
        where = {
            REPLICA_HEADER: serve.get_replica_context().replica_id.unique_id,
            NODE_HEADER: ray.get_runtime_context().get_node_id(),
        }
        app.add_middleware(ReplicaHeaders, headers=where)
        app.router.lifespan_context = _until_started(app.router.lifespan_context, runtime)
        return app

    def check_health(self) -> None:
        """Ray's health check: raises unless the engine can synthesise now."""
        runtime = self._runtime
        if runtime is None or not runtime.ready:
            phase = "not built" if runtime is None else runtime.phase.value
            alive = runtime is not None and runtime.engine_alive
            raise ReplicaNotReadyError(f"replica not ready: phase {phase}, engine alive: {alive}")


def _until_started(lifespan: Lifespan, runtime: ServerRuntime) -> Lifespan:
    """``lifespan``, whose start also waits for the model to load and warm up: Ray sends a
    replica requests once its start ends, and a failed start fails the replica."""

    @contextlib.asynccontextmanager
    async def started(app: FastAPI) -> AsyncIterator[Any]:
        async with lifespan(app) as state:
            while runtime.phase is Phase.STARTING:
                await asyncio.sleep(_START_POLL_S)
            if runtime.phase is not Phase.READY:
                raise ReplicaNotReadyError(f"the server did not start ({runtime.phase.value}); see its log")
            yield state

    return started


def build_app(args: dict[str, str]) -> Application:
    """Ray Serve's application builder: ``args`` are ``serve run``'s ``KEY=VALUE`` pairs
    (:mod:`cosyserve.deploy.ray_args`); raises :class:`~cosyserve.deploy.ray_args.RayArgsError`."""
    plan = plan_ray_app(args)
    deployment = serve.deployment(name=DEPLOYMENT_NAME)(serve.ingress()(SpeechReplica))
    return deployment.options(**plan.options).bind(plan.settings_values, plan.threads)
