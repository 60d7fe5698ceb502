"""The ``cosyserve`` command line: one root app with a sub-app per area (``model``, ...).

Errors that cosyserve raises on purpose (:class:`CosyserveError`) end the command with a
single ``error: ...`` line on stderr and exit status 2; anything else is a bug and keeps
its traceback. Logging is configured here and nowhere else.
"""

import logging
import time
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

import cosyserve.cli.auth as auth
import cosyserve.cli.bench as bench
import cosyserve.cli.ops as ops
import cosyserve.cli.serve as serve
import cosyserve.cli.synth as synth
from cosyserve.errors import CosyserveError
from cosyserve.modeldir.family import Family

EXIT_ERROR = 2


class _Group(TyperGroup):
    """Root group that turns a :class:`CosyserveError` from any sub-command into one line."""

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except CosyserveError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(EXIT_ERROR) from None


app = typer.Typer(
    cls=_Group,
    name="cosyserve",
    help="Inference server for CosyVoice 2 (CosyVoice2-0.5B).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
model_app = typer.Typer(help="Create and inspect model directories.", no_args_is_help=True)
app.add_typer(model_app, name="model")


class Size(StrEnum):
    tiny = "tiny"
    full = "full"


@app.callback()
def _root(
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log progress to stderr.")] = False,
) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


@model_app.command("init")
def model_init(
    directory: Annotated[Path, typer.Argument(help="Directory to create.")],
    size: Annotated[Size, typer.Option(help="tiny (tests) or full (the released geometry).")],
    seed: Annotated[int, typer.Option(help="Seed of every random weight.")] = 0,
    force: Annotated[bool, typer.Option("--force", help="Replace a non-empty directory.")] = False,
    family: Annotated[
        Family,
        typer.Option(help="cosyvoice2 (CosyVoice2-0.5B) or cosyvoice3 (Fun-CosyVoice3-0.5B-2512)."),
    ] = Family.COSYVOICE2,
    rl_lm: Annotated[
        bool, typer.Option("--rl-lm", help="CosyVoice 3: also write llm.rl.pt (an RL-tuned LM's place).")
    ] = False,
) -> None:
    """Write a model directory in the official layout with random weights."""
    # Imported here so that other commands (and --help) do not pay for torch and onnx.
    from cosyserve.models.generate import init_model_dir

    start = time.perf_counter()
    init_model_dir(directory, size.value, seed, force=force, family=family, rl_lm=rl_lm)
    elapsed = time.perf_counter() - start
    total = 0
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        size_bytes = path.stat().st_size
        total += size_bytes
        typer.echo(f"{_human(size_bytes):>10}  {path.relative_to(directory).as_posix()}")
    typer.echo(
        f"wrote {directory} ({family.value} {size.value}, seed {seed}): {_human(total)} in {elapsed:.1f} s"
    )


@model_app.command("rl")
def model_rl(
    source: Annotated[Path, typer.Argument(help="A Fun-CosyVoice3 directory with llm.rl.pt.")],
    target: Annotated[Path, typer.Argument(help="The view to create (a new directory).")],
) -> None:
    """Make a view of SOURCE whose LM is its RL-tuned one: symlinks and a manifest, no copies.
    Serve it alone, or beside SOURCE with two --model-dir."""
    from cosyserve.modeldir.rl_view import make_rl_view

    make_rl_view(source, target)
    typer.echo(
        f"wrote {target}: {source}'s files with llm.rl.pt as llm.pt; serve it with --model-dir {target}"
    )


def _human(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.2f} GiB"


for _module in (synth, serve, bench, ops, auth):
    _module.register(app)


def main() -> None:
    """Console-script entry point (``cosyserve``)."""
    app(prog_name="cosyserve")
