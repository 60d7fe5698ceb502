"""The ``cosyserve bench`` commands: ``bench engine`` (see :mod:`cosyserve.bench.engine_bench`)
and ``bench server`` (see :mod:`cosyserve.bench.server_load`)."""

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, TypeVar

import typer

from cosyserve.accel.precision_choices import Choices, Dtype, FlowQuantization, Profile, Quantization
from cosyserve.cli.precision import (
    device_option,
    dtype_option,
    flow_quantize_option,
    profile_option,
    quantize_option,
)
from cosyserve.paths import default_model_dir, require_model_dir

_Report = TypeVar("_Report")

bench_app = typer.Typer(help="Measure the engine's latency and throughput.", no_args_is_help=True)


# Report options shared by every bench command.
_JsonOut = Annotated[Path | None, typer.Option("--json", help="Write the full report as JSON here.")]
_MarkdownOut = Annotated[Path | None, typer.Option("--markdown", help="Write the Markdown table here.")]
_Progress = Annotated[bool, typer.Option(help="Show a progress bar on stderr.")]


def register(app: typer.Typer) -> None:
    """Add this module's commands to the root app."""
    app.add_typer(bench_app, name="bench")


def _levels(value: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(part) for part in value.split(",") if part.strip())
    except ValueError:
        raise typer.BadParameter(f"{value!r} is not a comma-separated list of integers") from None
    if not levels or min(levels) < 1:
        raise typer.BadParameter("give one or more concurrency levels of at least 1, e.g. 1,2,4,8,16")
    return levels


@bench_app.command("engine")
def bench_engine(
    model_dir: Annotated[
        Path | None,
        typer.Option(
            help="Model directory (default: $COSYSERVE_MODEL_DIR, else the cache).", show_default=False
        ),
    ] = None,
    tokens: Annotated[
        int, typer.Option(min=1, help="Speech tokens forced per request (25 per second).")
    ] = 150,
    concurrency: Annotated[
        str, typer.Option(help="Comma-separated concurrency levels, each run in turn.")
    ] = "1,2,4,8,16",
    stream: Annotated[bool, typer.Option("--stream", help="Streaming requests.")] = False,
    prompt_seconds: Annotated[
        float, typer.Option(min=0.1, help="Length of the synthetic voice prompt.")
    ] = 3.0,
    rounds: Annotated[int, typer.Option(min=1, help="Requests per level: rounds x concurrency.")] = 2,
    first_hop: Annotated[
        int | None, typer.Option(min=5, help="Tokens in a stream's first chunk (default: the plan's).")
    ] = None,
    threads: Annotated[int | None, typer.Option(min=1, help="torch threads (default: torch's).")] = None,
    profile: Annotated[Profile, profile_option()] = Profile.AUTO,
    dtype: Annotated[Dtype | None, dtype_option()] = None,
    quantize: Annotated[Quantization | None, quantize_option()] = None,
    flow_quantize: Annotated[FlowQuantization | None, flow_quantize_option()] = None,
    device: Annotated[str | None, device_option()] = None,
    seed: Annotated[int, typer.Option(min=0, help="Seed of the prompt, texts and sampling.")] = 0,
    warm_up: Annotated[bool, typer.Option(help="Run one short request before measuring.")] = True,
    json_out: _JsonOut = None,
    markdown_out: _MarkdownOut = None,
    progress: _Progress = True,
) -> None:
    """Latency percentiles, RTF, audio seconds per second, LM tokens/s and peak RSS per
    concurrency level, on a fixed synthetic workload with forced token counts."""
    levels = _levels(concurrency)
    # Imported here so that other commands (and --help) do not pay for torch.
    import torch

    from cosyserve.accel.machine import Machine
    from cosyserve.accel.plan import choose_plan
    from cosyserve.bench.engine_bench import BenchOptions, run_engine_bench
    from cosyserve.bench.report import report_json, report_markdown
    from cosyserve.engine.loader import load_model

    options = BenchOptions(
        tokens=tokens,
        concurrency=levels,
        stream=stream,
        prompt_seconds=prompt_seconds,
        rounds=rounds,
        seed=seed,
        first_hop=first_hop,
        warm_up=warm_up,
    )
    if threads is not None:
        torch.set_num_threads(threads)
    plan = choose_plan(Machine.detect(), profile, Choices(dtype, quantize, flow_quantize, device))
    model = load_model(require_model_dir(model_dir or default_model_dir()), plan)
    report = _with_progress(
        levels, lambda c: rounds * c, progress, lambda advance: run_engine_bench(model, options, advance)
    )
    _write_report(report_markdown(report), lambda: report_json(report), json_out, markdown_out)


@bench_app.command("server")
def bench_server(
    url: Annotated[str, typer.Option(help="Base URL of the running server.")] = "http://127.0.0.1:8000",
    concurrency: Annotated[
        str, typer.Option(help="Comma-separated concurrency levels, each run in turn.")
    ] = "1,4,16",
    requests: Annotated[int, typer.Option(min=1, help="Requests per level.")] = 32,
    stream: Annotated[bool, typer.Option("--stream", help="Streaming requests.")] = False,
    audio_format: Annotated[
        str, typer.Option("--format", help="Response format (OpenAI API; upstream is always PCM).")
    ] = "wav",
    api: Annotated[
        str,
        typer.Option(help="openai (/v1/audio/speech) or upstream (/inference_sft, /inference_zero_shot)."),
    ] = "openai",
    voice: Annotated[
        str | None, typer.Option(help="Registered or built-in voice (upstream: spk_id).")
    ] = None,
    prompt_wav: Annotated[
        Path | None, typer.Option(help="Upstream API without --voice: the prompt recording.")
    ] = None,
    prompt_text: Annotated[str, typer.Option(help="Transcript of --prompt-wav.")] = "",
    text: Annotated[str, typer.Option(help="Text of every request.")] = (
        "Hello, this is a load test of the speech server."
    ),
    tokens: Annotated[
        int | None, typer.Option(min=1, help="Force this many speech tokens (OpenAI API, cosyserve only).")
    ] = None,
    abort_fraction: Annotated[
        float, typer.Option(min=0.0, max=1.0, help="Share of requests that leave after their first byte.")
    ] = 0.0,
    sample_rate: Annotated[
        int | None, typer.Option(help="Ask for this output rate (OpenAI API; default: the model's).")
    ] = None,
    timeout: Annotated[
        float, typer.Option(min=1.0, help="Seconds before a request counts as timed out.")
    ] = 300.0,
    json_out: _JsonOut = None,
    markdown_out: _MarkdownOut = None,
    progress: _Progress = True,
) -> None:
    """Load a running server over HTTP: time to first audio byte, latency percentiles,
    requests/s, audio seconds/s and errors by status, per concurrency level."""
    levels = _levels(concurrency)
    if api not in ("openai", "upstream"):
        raise typer.BadParameter("--api is openai or upstream")

    from cosyserve.bench.server_load import LoadOptions, run_server_load
    from cosyserve.bench.server_report import server_report_json, server_report_markdown

    try:
        options = LoadOptions(
            url=url.rstrip("/"),
            concurrency=levels,
            requests=requests,
            stream=stream,
            format=audio_format,
            api="openai" if api == "openai" else "upstream",
            voice=voice,
            tokens=tokens,
            text=text,
            prompt_wav=None if prompt_wav is None else prompt_wav.read_bytes(),
            prompt_text=prompt_text,
            abort_fraction=abort_fraction,
            timeout_s=timeout,
            sample_rate=sample_rate,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    report = _with_progress(
        levels, lambda c: requests, progress, lambda advance: run_server_load(options, advance)
    )
    _write_report(server_report_markdown(report), lambda: server_report_json(report), json_out, markdown_out)


def _with_progress(
    levels: tuple[int, ...],
    total: Callable[[int], int],
    progress: bool,
    run: Callable[[Callable[[int], None]], _Report],
) -> _Report:
    """``run(advance)`` under a progress bar per concurrency level on stderr (``total(level)``
    requests each); ``advance(level)`` marks one request of that level done."""
    # Imported here so that other commands (and --help) do not pay for rich's progress.
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (
        TextColumn("concurrency {task.fields[level]:>3}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), disable=not progress) as bar:
        tasks = {c: bar.add_task("", total=total(c), level=c) for c in levels}
        return run(lambda level: bar.advance(tasks[level]))


def _write_report(
    table: str, to_json: Callable[[], str], json_out: Path | None, markdown_out: Path | None
) -> None:
    """The Markdown table to stdout (and ``markdown_out``), the JSON to ``json_out``."""
    if json_out is not None:
        json_out.write_text(to_json())
    if markdown_out is not None:
        markdown_out.write_text(table)
    typer.echo(table, nl=False)
