"""TorchScript as the CPU paths use it: frozen traces replayed in the plain interpreter,
and functions compiled from source where a tracer cannot record an op's call.

torch marks TorchScript deprecated in favour of ``torch.compile``, which cannot take
fbgemm's packed int8 weights or oneDNN's packed tensors (docs/benchmarks.md, "Run 33");
while TorchScript exists it is used, and its callers run eagerly where it fails.
"""

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

# A trace as its callers run it: a frozen module, or one loaded from the cache and bound to
# the live weights (cosyserve.models.trace_cache).
Trace = Callable[..., Any]


def trace_frozen(module: nn.Module, inputs: Sequence[Tensor]) -> torch.jit.ScriptModule:
    """``module`` traced on ``inputs`` and frozen: its submodules' calls inlined and its
    weights made constants, so the interpreter runs one flat graph (decode steps: 23.0
    against 24.0-25.5 ms at batch 1 on the full model, the same bits; docs/benchmarks.md,
    "Traced decode steps"). Opaque tensors (oneDNN's packed weights) cannot be constants:
    pass them among ``inputs``, which the tracer records as the graph's inputs.

    The sizes turn into traced values, and the branches taken on them are meant to be
    fixed: callers trace one example per branch."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning, message=r".*torch\.jit.*")
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)  # type: ignore[attr-defined]
        traced = torch.jit.trace(module, tuple(inputs), check_trace=False)  # type: ignore[no-untyped-call]
        frozen: torch.jit.ScriptModule = torch.jit.freeze(traced.eval())
    return frozen


def replay(traced: Trace, *inputs: Tensor) -> Any:
    """Run ``traced`` in the plain interpreter: the optimizing one profiles a graph's first
    two runs (290-380 ms each for a full-model decode step, against 76 ms) for no faster
    runs. Call it once right after tracing: a trace's first run builds its execution plan
    (about 30 MiB for a full-model decode step), which the process keeps, and built among
    the first requests' caches it kept their memory from being reused (a second burst of 8
    streams peaked at 14.1 GiB, against 9.3 GiB with plans built at start)."""
    with torch.jit.optimized_execution(False):  # type: ignore[attr-defined]  # not re-exported
        return traced(*inputs)


def compiled_function(source: str, name: str) -> Callable[..., Tensor]:
    """The TorchScript function ``name`` of ``source``: for op calls a tracer cannot record
    (an empty ``Scalar?[]`` argument, a type Python annotations cannot name)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning, message=r".*torch\.jit.*")
        unit = torch.jit.CompilationUnit(source)
    function: Callable[..., Tensor] = getattr(unit, name)
    return function
