"""Operations commands: ``download``, ``verify``, ``doctor``.

``download`` fetches the official weights (resumable) and writes the manifest that
``verify`` and ``serve`` check; ``doctor`` checks the whole machine and exits 1 on any
FAIL. Heavy modules are imported inside the commands, so ``--help`` stays fast.
"""

import time
from enum import StrEnum
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
from cosyserve.errors import ModelDirError
from cosyserve.modeldir.family import Family

EXIT_FAILED_CHECKS = 1


class SourceOption(StrEnum):
    huggingface = "huggingface"
    modelscope = "modelscope"


def register(app: typer.Typer) -> None:
    """Add this module's commands to the root app."""
    app.command("download")(download)
    app.command("verify")(verify)
    app.command("doctor")(doctor)


def download(
    source: Annotated[SourceOption, typer.Option(help="Where to fetch from.")] = SourceOption.huggingface,
    directory: Annotated[
        Path | None,
        typer.Option(
            "--dir",
            help="Target directory (default: $COSYSERVE_MODEL_DIR, else the cache).",
            show_default=False,
        ),
    ] = None,
    revision: Annotated[str | None, typer.Option(help="Branch, tag or commit (default: main).")] = None,
    endpoint: Annotated[
        str | None, typer.Option(help="Hub URL, e.g. a mirror (env: HF_ENDPOINT).", show_default=False)
    ] = None,
    everything: Annotated[
        bool, typer.Option("--all", help="The whole snapshot, not only the files cosyserve reads.")
    ] = False,
    family: Annotated[
        Family,
        typer.Option(
            "--model",
            help="cosyvoice2 (CosyVoice2-0.5B) or cosyvoice3 (Fun-CosyVoice3-0.5B-2512, its RL LM too).",
        ),
    ] = Family.COSYVOICE2,
) -> None:
    """Fetch official weights (resumable) and write their manifest."""
    from cosyserve.modeldir.download import Source
    from cosyserve.modeldir.download import download as fetch
    from cosyserve.paths import COSYVOICE3_MODEL_NAME, cached_model_dir, default_model_dir

    if directory is not None:
        target = directory
    elif family is Family.COSYVOICE2:
        target = default_model_dir()
    else:
        target = cached_model_dir(COSYVOICE3_MODEL_NAME)
    start = time.perf_counter()
    result = fetch(
        target,
        Source(source.value),
        family=family,
        revision=revision,
        endpoint=endpoint,
        everything=everything,
    )
    elapsed = time.perf_counter() - start
    at = f"@{result.commit[:12]}" if result.commit else ""
    typer.echo(
        f"{result.repo}{at}: {result.files} files, {_gib(result.total_bytes)} in {target} "
        f"({elapsed:.0f} s); manifest written"
    )
    if result.local_only:
        typer.echo(f"not from the snapshot, kept and listed as they are: {', '.join(result.local_only)}")
    if directory is not None and directory != default_model_dir():
        typer.echo(f"serve it with: cosyserve serve --model-dir {target}")


def verify(
    directory: Annotated[
        Path | None,
        typer.Argument(
            help="Model directory (default: $COSYSERVE_MODEL_DIR, else the cache).", show_default=False
        ),
    ] = None,
    hashes: Annotated[bool, typer.Option(help="Hash every file (--no-hashes: names only).")] = True,
    write: Annotated[
        bool, typer.Option("--write", help="Write the manifest from the files as they are now.")
    ] = False,
) -> None:
    """Check every file of a model directory against its manifest.sha256."""
    from cosyserve.modeldir.layout import MANIFEST_FILE, ModelDir
    from cosyserve.modeldir.manifest import check_manifest, listed_files, write_manifest
    from cosyserve.modeldir.preflight import download_command
    from cosyserve.paths import default_model_dir

    root = directory or default_model_dir()
    if not root.exists():
        raise ModelDirError(
            f"model directory {root} does not exist; fetch it with `{download_command(root)}`"
        )
    ModelDir.open(root)
    if write:
        path = write_manifest(root)
        typer.echo(f"wrote {path}: {len(listed_files(root))} files")
        return
    if not (root / MANIFEST_FILE).is_file():
        raise ModelDirError(
            f"{root} has no {MANIFEST_FILE}; if its files are known good, write one with "
            f"`cosyserve verify --write {root}`"
        )
    start = time.perf_counter()
    problems = check_manifest(root, hashes=hashes)
    elapsed = time.perf_counter() - start
    for problem in problems:
        typer.echo(f"FAIL  {problem}")
    if problems:
        raise ModelDirError(f"{len(problems)} file(s) do not match {root / MANIFEST_FILE}")
    names = listed_files(root)
    size = sum((root / name).stat().st_size for name in names)
    what = "sha256 of" if hashes else "names of"
    typer.echo(f"OK    {what} {len(names)} files ({_gib(size)}) match {MANIFEST_FILE} ({elapsed:.1f} s)")


def doctor(
    model_dir: Annotated[Path | None, typer.Option(help="Model directory (default: as serve).")] = None,
    host: Annotated[str | None, typer.Option(help="Listen address (default: as serve).")] = None,
    port: Annotated[int | None, typer.Option(help="HTTP port (default: as serve).")] = None,
    grpc_port: Annotated[int | None, typer.Option(help="gRPC port (default: as serve).")] = None,
    config: Annotated[Path | None, typer.Option(help="TOML settings file, as for serve.")] = None,
    profile: Annotated[Profile | None, profile_option()] = None,
    device: Annotated[str | None, device_option()] = None,
    dtype: Annotated[Dtype | None, dtype_option()] = None,
    quantize: Annotated[Quantization | None, quantize_option()] = None,
    flow_quantize: Annotated[FlowQuantization | None, flow_quantize_option()] = None,
    hashes: Annotated[bool, typer.Option(help="Hash the model files (--no-hashes: names only).")] = True,
) -> None:
    """Check that this machine can serve: OK/WARN/FAIL with advice; exit 1 on any FAIL.

    The speed plan serve would run, Python, torch, GPU and driver, precision and GPU memory,
    onnxruntime, audio codecs, wetext, the model directory, disk and ports.
    """
    import cosyserve.cli.doctor as checks
    from cosyserve.server.settings import Settings

    settings = Settings.load(
        config,
        model_dir=model_dir,
        host=host,
        port=port,
        grpc_port=grpc_port,
        profile=profile,
        device=device,
        dtype=dtype,
        quantize=quantize,
        flow_quantize=flow_quantize,
    )
    facts = checks.gather(
        settings.first_model_dir,
        settings.host,
        [("HTTP", settings.port), ("gRPC", settings.grpc_port)],
        verify_hashes=hashes,
        profile=settings.profile,
        choices=settings.choices(),
    )
    intent = facts.intent(settings.device, settings.dtype, settings.quantize)
    results = checks.evaluate(facts, intent)
    typer.echo(checks.render(results))
    code = checks.exit_code(results)
    if code:
        raise typer.Exit(code)


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"
