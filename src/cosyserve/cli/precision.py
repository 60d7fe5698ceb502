"""The precision options shared by ``serve``, ``synth`` and ``bench engine``.

Their choices are the :class:`Dtype`, :class:`Quantization` and :class:`FlowQuantization`
enums themselves (defined without torch, so ``--help`` stays fast). ``serve`` declares them
optional, so that a missing flag leaves the setting to the environment or config file; the
other commands default to the float32 CPU model. Each call makes a fresh option for one parameter.
"""

from typing import Any

import typer


def dtype_option() -> Any:
    return typer.Option(help="LM and flow dtype; fp16 needs CUDA (HiFT stays fp32).")


def quantize_option() -> Any:
    return typer.Option(help="LM weight quantization; int4 needs CUDA.")


def flow_quantize_option() -> Any:
    return typer.Option(help="Flow estimator weights: fp16 stores them half-size (CPU, fp32 flow).")


def device_option() -> Any:
    return typer.Option(help="Device of the model and KV cache: cpu or cuda[:N].")
