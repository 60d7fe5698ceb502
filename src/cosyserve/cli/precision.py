"""The profile and precision options shared by ``serve``, ``synth`` and ``bench engine``.

Their choices are the :class:`Profile`, :class:`Dtype`, :class:`Quantization` and
:class:`FlowQuantization` enums themselves (defined without torch, so ``--help`` stays
fast). Unset, each is the profile's choice (``serve``: from the environment or config file
first). Each call makes a fresh option for one parameter; ``panel`` groups it in ``--help``.
"""

from typing import Any

import typer

_PROFILES = "(default: the profile's)"


def profile_option(panel: str | None = None) -> Any:
    return typer.Option(
        help="auto: the fastest plan measured for this machine; fast; exact: float32, upstream's "
        "output (default: auto).",
        rich_help_panel=panel,
    )


def dtype_option(panel: str | None = None) -> Any:
    return typer.Option(
        help="LM and flow dtype; fp16 needs CUDA (default: the profile's).", rich_help_panel=panel
    )


def quantize_option(panel: str | None = None) -> Any:
    return typer.Option(
        help="LM weight quantization; int4 needs CUDA (default: the profile's).", rich_help_panel=panel
    )


def flow_quantize_option(panel: str | None = None) -> Any:
    return typer.Option(
        help=f"Flow weights: fp16 stores them half-size (CPU, fp32 flow) {_PROFILES}.",
        rich_help_panel=panel,
    )


def device_option(panel: str | None = None) -> Any:
    return typer.Option(
        help="cpu or cuda[:N] (default: the profile's: a GPU if there is one).", rich_help_panel=panel
    )
