"""The ``cosyserve serve`` command: the HTTP server (uvicorn), and gRPC, in one process.

Flags override ``COSYSERVE_*`` variables, which override the ``--config`` TOML file (see
:mod:`cosyserve.server.settings`). With ``--workers N``, N processes serve one port, each with
its own engine; the weights are memory-mapped from the model files, so the processes
share those pages. SIGTERM (or Ctrl-C) drains: listeners close, in-flight requests get
``--shutdown-grace`` seconds to finish, then whatever is left is aborted
(:mod:`cosyserve.server.runner`).
"""

from pathlib import Path
from typing import Annotated

import typer

from cosyserve.accel.precision_choices import Dtype, FlowQuantization, Profile, Quantization
from cosyserve.cli.precision import (
    device_option,
    dtype_option,
    flow_quantize_option,
    profile_option,
    quantize_option,
)


def register(app: typer.Typer) -> None:
    """Add this module's commands to the root app."""
    from cosyserve.server.settings import settings_reference

    sections = []
    for group, rows in settings_reference():
        lines = [f"{name} ({env}) = {default}: {text}" for name, env, default, text in rows]
        sections.append(f"{group.upper()}\n\n" + "\n\n".join(lines))
    epilog = "Every setting (TOML key, environment variable, default), by group:\n\n" + "\n\n".join(sections)
    app.command("serve", epilog=epilog)(serve)


_MODEL, _SERVER, _LIMITS, _AUTH, _LOGGING = "Model", "Server", "Limits", "Auth", "Logging"


def serve(
    model_dir: Annotated[
        list[Path] | None,
        typer.Option(
            help="Model directory (CosyVoice 2 or 3); repeat to serve several, picked by the request's "
            "model (the first by default).",
            rich_help_panel=_MODEL,
        ),
    ] = None,
    profile: Annotated[Profile | None, profile_option(_MODEL)] = None,
    dtype: Annotated[Dtype | None, dtype_option(_MODEL)] = None,
    quantize: Annotated[Quantization | None, quantize_option(_MODEL)] = None,
    flow_quantize: Annotated[FlowQuantization | None, flow_quantize_option(_MODEL)] = None,
    device: Annotated[str | None, device_option(_MODEL)] = None,
    default_voice: Annotated[
        str | None,
        typer.Option(
            help="Voice of requests that name none (default: the first built-in).", rich_help_panel=_MODEL
        ),
    ] = None,
    pronunciations: Annotated[
        str | None,
        typer.Option(
            help="Pronunciation dictionary file, reloaded on SIGHUP (docs/cosyvoice3.md).",
            rich_help_panel=_MODEL,
            show_default=False,
        ),
    ] = None,
    voices_db: Annotated[
        str | None,
        typer.Option(
            help="Registered voices: an SQLite file, a postgresql:// URL or @FILE.", rich_help_panel=_MODEL
        ),
    ] = None,
    host: Annotated[
        str | None, typer.Option(help="Listen address (default: 127.0.0.1).", rich_help_panel=_SERVER)
    ] = None,
    port: Annotated[
        int | None, typer.Option(help="HTTP port; 0: any free one (default: 8000).", rich_help_panel=_SERVER)
    ] = None,
    grpc_port: Annotated[
        int | None, typer.Option(help="gRPC port; 0 disables (default: 50051).", rich_help_panel=_SERVER)
    ] = None,
    workers: Annotated[
        int | None, typer.Option(help="Server processes (default: 1).", rich_help_panel=_SERVER)
    ] = None,
    shutdown_grace: Annotated[
        float | None, typer.Option(help="Seconds in-flight requests get on SIGTERM.", rich_help_panel=_SERVER)
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(
            help="TOML settings file (env: COSYSERVE_CONFIG).", show_default=False, rich_help_panel=_SERVER
        ),
    ] = None,
    max_active: Annotated[
        int | None, typer.Option(help="Concurrent syntheses per process.", rich_help_panel=_LIMITS)
    ] = None,
    max_queued: Annotated[
        int | None, typer.Option(help="Queued requests beyond that (429 past).", rich_help_panel=_LIMITS)
    ] = None,
    deadline: Annotated[
        float | None, typer.Option(help="Per-request limit in seconds; 0: none.", rich_help_panel=_LIMITS)
    ] = None,
    max_text_chars: Annotated[
        int | None, typer.Option(help="Longest input of /v1/audio/speech.", rich_help_panel=_LIMITS)
    ] = None,
    auth_mode: Annotated[
        str | None,
        typer.Option(
            help="on: credentials required (auth_* settings); none: open (default: on).",
            rich_help_panel=_AUTH,
        ),
    ] = None,
    log_level: Annotated[
        str | None, typer.Option(help="critical|error|warning|info|debug.", rich_help_panel=_LOGGING)
    ] = None,
    log_text_chars: Annotated[
        int | None,
        typer.Option(help="Characters of request text in the log (default: 0).", rich_help_panel=_LOGGING),
    ] = None,
) -> None:
    """Run the speech server (OpenAI-compatible HTTP API, and gRPC). Every setting is also a
    COSYSERVE_* variable and a key of the --config file (listed below)."""
    # Imported here so that other commands (and --help) do not pay for the server stack.
    from cosyserve.accel.machine import Machine
    from cosyserve.accel.plan import choose_plan
    from cosyserve.paths import require_model_dir
    from cosyserve.server.runner import run
    from cosyserve.server.settings import Settings

    settings = Settings.load(
        config,
        model_dir=tuple(model_dir) if model_dir else None,
        profile=profile,
        dtype=dtype,
        quantize=quantize,
        flow_quantize=flow_quantize,
        device=device,
        default_voice=default_voice,
        pronunciations=pronunciations,
        voices_db=voices_db,
        host=host,
        port=port,
        grpc_port=grpc_port,
        workers=workers,
        shutdown_grace_s=shutdown_grace,
        max_active=max_active,
        max_queued=max_queued,
        deadline_s=deadline,
        max_text_chars=max_text_chars,
        auth_mode=auth_mode,
        log_level=log_level,
        log_text_chars=log_text_chars,
    )
    for directory in settings.model_dir:
        require_model_dir(directory)  # a wrong path fails here, in one line
    # So does a choice this machine cannot run (e.g. fp16 on CPU), before any worker starts.
    choose_plan(Machine.detect(), settings.profile, settings.choices())
    run(settings)
