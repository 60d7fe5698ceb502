"""The ``cosyserve serve`` command: the HTTP server (uvicorn), and gRPC, in one process.

Flags override ``COSYSERVE_*`` variables, which override the ``--config`` TOML file (see
:mod:`cosyserve.settings`). With ``--workers N`` uvicorn runs N processes behind one port,
each with its own engine; the weights are memory-mapped from the model files, so the
processes share those pages. SIGTERM (or Ctrl-C) drains: listeners close, in-flight
requests get ``--shutdown-grace`` seconds to finish, then whatever is left is aborted.

The server's log format and level are set here, through uvicorn's logging config, so that
worker processes (which never run the root command) get them too.
"""

import logging
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from cosyserve.errors import CosyserveError

if TYPE_CHECKING:
    from cosyserve.settings import Settings

logger = logging.getLogger(__name__)

# uvicorn imports the worker factory by name in each worker process.
_WORKER_FACTORY = "cosyserve.server.app:app_from_env"
_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access")


class ServerStartError(CosyserveError):
    code = "server_start_failed"


def register(app: typer.Typer) -> None:
    """Add this module's commands to the root app."""
    app.command("serve")(serve)


def serve(
    model_dir: Annotated[Path | None, typer.Option(help="CosyVoice2-0.5B model directory.")] = None,
    host: Annotated[str | None, typer.Option(help="Listen address [default: 127.0.0.1].")] = None,
    port: Annotated[int | None, typer.Option(help="HTTP port [default: 8000].")] = None,
    grpc_port: Annotated[int | None, typer.Option(help="gRPC port; 0 disables [default: 50051].")] = None,
    workers: Annotated[int | None, typer.Option(help="Server processes [default: 1].")] = None,
    config: Annotated[
        Path | None, typer.Option(help="TOML settings file [env: COSYSERVE_CONFIG].", show_default=False)
    ] = None,
    max_active: Annotated[int | None, typer.Option(help="Concurrent syntheses per process.")] = None,
    max_queued: Annotated[int | None, typer.Option(help="Queued requests beyond that (429 past).")] = None,
    deadline: Annotated[float | None, typer.Option(help="Per-request limit in seconds; 0: none.")] = None,
    max_text_chars: Annotated[int | None, typer.Option(help="Longest input of /v1/audio/speech.")] = None,
    voices_db: Annotated[Path | None, typer.Option(help="SQLite file of registered voices.")] = None,
    shutdown_grace: Annotated[
        float | None, typer.Option(help="Seconds in-flight requests get on SIGTERM.")
    ] = None,
    log_level: Annotated[str | None, typer.Option(help="critical|error|warning|info|debug.")] = None,
) -> None:
    """Run the speech server (OpenAI-compatible HTTP API, and gRPC)."""
    # Imported here so that other commands (and --help) do not pay for the server stack.
    from cosyserve.modeldir.layout import ModelDir
    from cosyserve.settings import Settings

    settings = Settings.load(
        config,
        model_dir=model_dir,
        host=host,
        port=port,
        grpc_port=grpc_port,
        workers=workers,
        max_active=max_active,
        max_queued=max_queued,
        deadline_s=deadline,
        max_text_chars=max_text_chars,
        voices_db=voices_db,
        shutdown_grace_s=shutdown_grace,
        log_level=log_level,
    )
    ModelDir.open(settings.model_dir)  # a wrong directory fails here, in one line
    if settings.workers == 1:
        _run_single(settings)
    else:
        _run_workers(settings)


def _uvicorn_config(settings: "Settings", app: Any, **extra: Any) -> Any:
    import uvicorn

    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=_log_config(settings.log_level),
        log_level=settings.log_level,
        # uvicorn waits this long for open connections, then cancels their tasks.
        timeout_graceful_shutdown=math.ceil(settings.shutdown_grace_s),
        **extra,
    )


def _run_single(settings: "Settings") -> None:
    import uvicorn

    from cosyserve.server.app import create_app

    failed = False

    def on_fatal() -> None:
        nonlocal failed
        failed = True
        server.should_exit = True

    app = create_app(settings, on_fatal=on_fatal)

    class Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            for listener in self.servers:
                for sock in listener.sockets:
                    address, bound_port = sock.getsockname()[:2]
                    logger.info("HTTP listening on http://%s:%d", address, bound_port)

        async def shutdown(self, sockets: Any = None) -> None:
            await app.state.runtime.drain()
            await super().shutdown(sockets)

    server = Server(_uvicorn_config(settings, app))
    server.run()
    if failed:
        raise ServerStartError("the server could not start; see the log above")


def _run_workers(settings: "Settings") -> None:
    from uvicorn.supervisors import Multiprocess

    # Worker processes read their settings from the environment (app_from_env).
    os.environ.update(settings.to_env())
    os.environ.pop("COSYSERVE_CONFIG", None)
    config = _uvicorn_config(settings, _WORKER_FACTORY, factory=True, workers=settings.workers)
    sock = config.bind_socket()
    address, bound_port = sock.getsockname()[:2]
    logger.info("HTTP listening on http://%s:%d (%d workers)", address, bound_port, settings.workers)
    Multiprocess(config, sockets=[sock]).run()


def _log_config(level: str) -> dict[str, Any]:
    """One stderr handler on the root logger; uvicorn's loggers propagate to it."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": {"format": _LOG_FORMAT}},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "plain"}},
        "root": {"handlers": ["stderr"], "level": level.upper()},
        "loggers": {name: {"handlers": [], "propagate": True} for name in _UVICORN_LOGGERS},
    }
