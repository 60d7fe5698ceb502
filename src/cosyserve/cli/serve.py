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

from cosyserve.accel.precision_choices import Dtype, FlowQuantization, Quantization
from cosyserve.cli.precision import device_option, dtype_option, flow_quantize_option, quantize_option


def register(app: typer.Typer) -> None:
    """Add this module's commands to the root app."""
    from cosyserve.server.settings import settings_reference

    lines = [f"{name} ({env}) = {default}: {text}" for name, env, default, text in settings_reference()]
    epilog = "Every setting (TOML key, environment variable, default):\n\n" + "\n\n".join(lines)
    app.command("serve", epilog=epilog)(serve)


def serve(
    model_dir: Annotated[Path | None, typer.Option(help="CosyVoice2-0.5B model directory.")] = None,
    host: Annotated[str | None, typer.Option(help="Listen address [default: 127.0.0.1].")] = None,
    port: Annotated[int | None, typer.Option(help="HTTP port; 0: any free one [default: 8000].")] = None,
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
    log_format: Annotated[str | None, typer.Option(help="json|text [default: json].")] = None,
    log_text_chars: Annotated[
        int | None, typer.Option(help="Characters of request text in the log [default: 0].")
    ] = None,
    auth_mode: Annotated[
        str | None, typer.Option(help="on: credentials required (auth_* settings); none: open [default: on].")
    ] = None,
    dtype: Annotated[Dtype | None, dtype_option()] = None,
    quantize: Annotated[Quantization | None, quantize_option()] = None,
    flow_quantize: Annotated[FlowQuantization | None, flow_quantize_option()] = None,
    device: Annotated[str | None, device_option()] = None,
    compile: Annotated[
        bool | None,
        typer.Option("--compile/--no-compile", help="torch.compile the LM's MLPs (unquantized LM only)."),
    ] = None,
) -> None:
    """Run the speech server (OpenAI-compatible HTTP API, and gRPC)."""
    # Imported here so that other commands (and --help) do not pay for the server stack.
    from cosyserve.accel.precision import Precision
    from cosyserve.paths import require_model_dir
    from cosyserve.server.runner import run
    from cosyserve.server.settings import Settings

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
        log_format=log_format,
        log_text_chars=log_text_chars,
        auth_mode=auth_mode,
        dtype=dtype,
        quantize=quantize,
        flow_quantize=flow_quantize,
        device=device,
        compile=compile,
    )
    require_model_dir(settings.model_dir)  # a wrong path fails here, in one line
    # So does a precision this machine cannot run (e.g. fp16 on CPU), before any worker starts.
    Precision.resolve(
        settings.dtype, settings.quantize, settings.device, settings.compile, settings.flow_quantize
    )

    run(settings)
