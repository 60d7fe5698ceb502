"""The LM's int8 weights a second time, packed for oneDNN's int8 matmul, for calls of
several rows.

:class:`~cosyserve.accel.quantize.Int8DynamicLinear` quantizes each input row on its own
scale and calls fbgemm's dynamic int8 Linear. fbgemm reads a weight fastest for one or two
rows, but its matmul hardly gains from more rows. On a CPU with AMX tiles, oneDNN's int8
matmul (``onednn::qlinear_pointwise``, the op torch's compiler emits for quantized CPU
Linears) is the slower of the two for one or two rows and the faster from about three on,
about twice as fast as fbgemm over the LM's 24 decoder layers at 100 rows. So calls of
:data:`MIN_ROWS` rows or more (batched decode steps, prefills) go to oneDNN, and a lone
decode row stays on fbgemm, or on our kernel where it runs (AMX CPUs have AVX-512 VNNI:
:mod:`cosyserve.accel.native_int8`). At 2 rows oneDNN is the slower, but the engine's
decode traces serve every batch of 2 or more with one trace recorded at 2 rows. This
costs a second copy of the int8 weights (341 MiB on the full model).

The two give the same bits. The activations are quantized as fbgemm quantizes them on
the range [-1, 1] that the row scaling sets (7 bits, ``reduce_range``: scale 2/127, zero
point 64), the int32 sums are exact, and both scale them back the same way, except in
oneDNN's kernel for small products (:data:`MIN_OUTPUTS`). Each weight is checked on this
machine before it is used (:meth:`OneDnnInt8Weight.same_as_fbgemm`), so a row's output
still does not depend on the call it is in.
"""

import logging
from collections.abc import Callable

import torch

from cosyserve.models.torchscript import compiled_function

logger = logging.getLogger(__name__)

# The fewest rows a call must have to go to oneDNN: from 3 on it is the faster (see the
# module doc), and the decode trace that serves batches of 2 or more is recorded at 2 rows.
MIN_ROWS = 2
# Outputs (rows x out features) below which oneDNN runs another kernel, whose sums are
# scaled back in another order than fbgemm's (last-bit differences, seen at 48-256 outputs).
MIN_OUTPUTS = 1024
# The grid of every int8 input row: the parameters torch's dynamic op picks for an input
# whose range is exactly [-1, 1], with reduce_range (Int8DynamicLinear).
INPUT_SCALE = 2.0 / 127
INPUT_ZERO_POINT = 64

OneDnnLinear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# TorchScript source, compiled by _scripted_linear. The op's empty post-op list has the type
# Scalar?[], which Python annotations cannot name.
_LINEAR_SOURCE = """
def linear(x: Tensor, weight: Tensor, scales: Tensor, zeros: Tensor) -> Tensor:
    q = torch.quantize_per_tensor(x, SCALE, ZERO_POINT, torch.quint8).int_repr()
    no_args: List[Optional[number]] = []
    return torch.ops.onednn.qlinear_pointwise(
        q, SCALE, ZERO_POINT, weight, scales, zeros, None, 1.0, 0, torch.float32, "none", no_args, ""
    )
"""


def _scripted_linear() -> OneDnnLinear:
    """The op call as a TorchScript function: a decode step's trace records it as a call
    (tracing the op itself fails on its empty list of post-op arguments)."""
    source = _LINEAR_SOURCE.replace("ZERO_POINT", str(INPUT_ZERO_POINT)).replace("SCALE", repr(INPUT_SCALE))
    return compiled_function(source, "linear")


class OneDnnInt8Weight:
    """One Linear's int8 weight (symmetric, one scale per output row) packed for oneDNN.

    ``packed`` is an opaque oneDNN tensor: it has no storage to share or copy. A trace that
    runs :meth:`__call__` must take it as an input (``DecodeGraphs``). ``min_rows``: the
    fewest rows a call must have to come here (see :data:`MIN_OUTPUTS`)."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, linear: OneDnnLinear) -> None:
        """``weight``: (out, in) int8; ``scales``: (out,) float32."""
        self.packed = torch.ops.onednn.qlinear_prepack(weight, None)
        self.scales = scales.float().contiguous()
        self.zeros = torch.zeros(weight.shape[0], dtype=torch.int32)
        self.in_features = int(weight.shape[1])
        self.min_rows = max(MIN_ROWS, -(-MIN_OUTPUTS // weight.shape[0]))
        self._linear = linear

    @classmethod
    def from_fbgemm(cls, packed: torch.ScriptObject, linear: OneDnnLinear) -> "OneDnnInt8Weight":
        """From fbgemm's packed qint8 weight without a bias (per tensor or per output row)."""
        weight, bias = torch.ops.quantized.linear_unpack(packed)
        if weight.qscheme() == torch.per_tensor_affine:
            scales = torch.full((weight.shape[0],), weight.q_scale())
            zeros = torch.tensor([weight.q_zero_point()])
        else:
            scales, zeros = weight.q_per_channel_scales(), weight.q_per_channel_zero_points()
        if bias is not None or bool(zeros.any()):
            raise ValueError("expected symmetric int8 weights without a bias")
        return cls(weight.int_repr(), scales, linear)

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows``: (M, in) float32 within [-1, 1], ``M >= min_rows`` -> (M, out) float32."""
        return self._linear(rows, self.packed, self.scales, self.zeros)

    def same_as_fbgemm(self, packed: torch.ScriptObject) -> bool:
        """Whether calls of ``min_rows`` rows and more give fbgemm's bits on ``packed`` (the
        same weight), for random rows that span [-1, 1] as fbgemm's calls do."""
        gen = torch.Generator().manual_seed(0)
        for count in sorted({self.min_rows, self.min_rows + 1, self.min_rows + 5, 64, 100}):
            if count < self.min_rows:
                continue
            rows = torch.rand(count, self.in_features, generator=gen) * 2 - 1
            rows[:, :2] = torch.tensor([1.0, -1.0])
            if not torch.equal(self(rows), torch.ops.quantized.linear_dynamic(rows, packed, True)):
                return False
        return True


class OneDnnPacker:
    """Packs int8 Linears' weights for oneDNN as they are quantized, each shape checked
    against fbgemm once (:meth:`OneDnnInt8Weight.same_as_fbgemm`). Build it with
    :meth:`create`."""

    def __init__(self, linear: OneDnnLinear) -> None:
        self._linear = linear
        self._checked: dict[tuple[int, int], bool] = {}  # (in, out) -> same bits as fbgemm

    @classmethod
    def create(cls) -> "OneDnnPacker | None":
        """A packer for oneDNN's int8 matmul, which is worth a second copy of the weights on
        a CPU with AMX tiles (the plan's ``onednn_int8``); None where this torch lacks the
        ops."""
        try:
            return cls(_scripted_linear())
        except (AttributeError, RuntimeError) as exc:
            logger.warning(
                "oneDNN int8 matmuls are unavailable (%s); fbgemm runs every call", type(exc).__name__
            )
            return None

    def pack(self, fbgemm: torch.ScriptObject) -> OneDnnInt8Weight | None:
        """fbgemm's packed weight (no bias) for oneDNN, or None where its shape gives other bits."""
        weight = OneDnnInt8Weight.from_fbgemm(fbgemm, self._linear)
        shape = (weight.in_features, int(weight.scales.shape[0]))
        if shape not in self._checked:
            self._checked[shape] = weight.same_as_fbgemm(fbgemm)
            if not self._checked[shape]:
                logger.warning("int8 Linears of shape %s stay on fbgemm: oneDNN gives other bits", shape)
        return weight if self._checked[shape] else None
