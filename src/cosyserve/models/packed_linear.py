"""bfloat16 Linear layers whose weights are laid out for oneDNN once, at load.

torch's CPU bfloat16 ``F.linear`` runs a oneDNN matmul that first reorders the weight into
the blocked layout its kernels (AMX tiles, AVX-512 bf16) read, on every call. The flow
estimator makes about 2,500 Linear calls per stream chunk (10 Euler steps x 56
transformer blocks x 4, plus the resnets), each on a weight of 0.25-0.75 MiB and, in a
stream's first chunk, only 20 rows (10 frames, both CFG branches): there the reorder is
a large share of the call. :class:`PackedLinear` keeps the reordered weight
(``mkldnn::_reorder_linear_weight``) and calls the matmul on it directly
(``mkldnn::_linear_pointwise``, the op torch's own compiler emits for frozen CPU
Linears). The results are bit-identical to ``F.linear``'s on a contiguous input: the same
kernel on the same weight; only the per-call reorder is gone. (On a strided view
``F.linear`` takes another path whose sums differ in the last bits; the packed call gives
the contiguous result. The estimator's Linears all get contiguous inputs.)

On a CPU with AMX, packing takes about a tenth off a stream's first flow chunk and a few
percent off a non-streaming flow, with the same mel.
"""

import functools
import logging
from collections.abc import Callable

import torch
from torch import nn

from cosyserve.models.torchscript import compiled_function

logger = logging.getLogger(__name__)


class PackedLinear(nn.Module):
    """A bfloat16 CPU Linear on a weight reordered once for oneDNN (see the module doc).

    The packed weight is an opaque oneDNN tensor: it has no storage to share, copy or
    move, so it is held as a plain attribute, not a parameter or buffer."""

    bias: torch.Tensor | None

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach()
        if not _bf16_on_cpu(weight):
            raise ValueError(
                f"PackedLinear takes a bfloat16 CPU Linear, not {weight.dtype} on {weight.device}"
            )
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        bias = None if linear.bias is None else linear.bias.detach()
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: (..., in) bfloat16 -> (..., out) bfloat16."""
        return self._matmul(x, "none", "")

    def gelu(self, x: torch.Tensor) -> torch.Tensor:
        """``gelu(self(x))`` (exact, with erf) in one call: oneDNN applies the GELU to the
        float32 sums before rounding them to bfloat16 once, where ``F.gelu`` would take the
        rounded output, round again, and cost a pass of its own: a non-streaming flow's
        feed-forward takes about a fifth less time, and on average the result is as close to
        float64 as the two-step one or closer (``docs/precision.md``, "How each choice
        works")."""
        return self._matmul(x, "gelu", "none")

    def _matmul(self, x: torch.Tensor, attr: str, algorithm: str) -> torch.Tensor:
        if torch.jit.is_tracing():  # type: ignore[attr-defined,no-untyped-call]  # not re-exported, untyped
            return _scripted_linear()(x, self.packed, self.bias, attr, algorithm)
        y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, attr, [], algorithm)
        return y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bf16 packed for oneDNN"


# The op call as TorchScript source, for traces (flow/traced_steps.py): a tracer cannot
# record the op's empty Scalar?[] argument, which Python annotations cannot name.
_LINEAR_SOURCE = """
def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], attr: str, algorithm: str) -> Tensor:
    no_scalars: List[Optional[number]] = []
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, attr, no_scalars, algorithm)
"""


@functools.cache
def _scripted_linear() -> Callable[..., torch.Tensor]:
    return compiled_function(_LINEAR_SOURCE, "linear")


def packing_available() -> bool:
    """Whether this torch runs oneDNN's bfloat16 matmul on packed weights: the ops exist and
    give ``F.linear``'s result on a small case. Whether packing pays on this CPU is the
    plan's ``packed_bf16`` (oneDNN runs bfloat16 natively)."""
    try:
        probe = nn.Linear(32, 16, dtype=torch.bfloat16)
        x = torch.ones(2, 32, dtype=torch.bfloat16)
        return bool(torch.equal(PackedLinear(probe)(x), probe(x)))
    except (AttributeError, RuntimeError) as exc:
        logger.warning("oneDNN packed bf16 Linears are unavailable (%s); using F.linear", type(exc).__name__)
        return False


def pack_linears_(module: nn.Module) -> int:
    """Replace every bfloat16 CPU ``nn.Linear`` under ``module`` by a :class:`PackedLinear`
    in place; returns how many. Nothing changes where :func:`packing_available` says no.
    The reordered copies replace the weights, which were private bfloat16 copies of the
    checkpoint's float32 ones, of the same size; the allocator may keep the freed pages
    for later allocations (a stream's peak rises by a few tens of MiB on the full model)."""
    if not packing_available():
        return 0
    targets = [
        (parent, name, child)
        for parent in module.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear) and _bf16_on_cpu(child.weight)
    ]
    for parent, name, linear in targets:
        setattr(parent, name, PackedLinear(linear))
    return len(targets)


def _bf16_on_cpu(weight: torch.Tensor) -> bool:
    return weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
