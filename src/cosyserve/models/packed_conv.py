"""float32 1-D convolutions whose weights are laid out for oneDNN once, at load (HiFT).

torch's CPU convolution runs oneDNN, which first reorders the weight into the blocked
layout its kernels read, on every call. HiFT makes 82 convolutions per call, whose
weights (up to 256 x 256 x 11) are reordered each time. :class:`PackedConv1d` keeps the
reordered weight (``mkldnn::_reorder_convolution_weight``) and calls the convolution on it
(``mkldnn::_convolution_pointwise``, the op torch's own compiler emits for frozen CPU
convolutions). oneDNN takes no 1-D weights, so the convolution runs as a 2-D one of height
1: ``(B, C, T)`` is viewed as ``(B, C, 1, T)``, without a copy.

The sums run in another order than the unpacked call's: a convolution's outputs differ in
their last bits, and 6 s of audio from the full-size random model by up to 1.7e-4 (of a
peak of 0.99), within HiFT's tolerance against upstream (``tests/models/test_hift_parity.py``).
On 2 cores of an Intel Xeon with AMX, HiFT took 0.72 against 0.82 s for 300 frames
(``docs/benchmarks.md``, "Run 52").
"""

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)

# The input length oneDNN is told to expect when it picks the weight's layout; the packed
# weight serves every length (HiFT's run from a stream chunk's few frames to 36,000).
_LAYOUT_LENGTH = 1024


class PackedConv1d(nn.Module):
    """A float32 CPU ``nn.Conv1d`` (zero padding) on a weight reordered once for oneDNN.

    The packed weight is an opaque oneDNN tensor, held as a plain attribute (it has no
    storage to share, copy or move); the convolution's own weight is not kept."""

    bias: torch.Tensor | None

    def __init__(self, conv: nn.Conv1d) -> None:
        super().__init__()
        weight = conv.weight.detach()
        if not _float32_on_cpu(weight) or conv.padding_mode != "zeros":
            raise ValueError(
                f"PackedConv1d takes a float32 CPU Conv1d with zero padding, not {weight.dtype} "
                f"on {weight.device} with {conv.padding_mode!r} padding"
            )
        if isinstance(conv.padding, str):
            raise ValueError(f"PackedConv1d takes numeric padding, not {conv.padding!r}")
        # As a 2-D convolution of height 1: (out, in / groups, 1, k).
        self.padding = [0, conv.padding[0]]
        self.stride = [1, conv.stride[0]]
        self.dilation = [1, conv.dilation[0]]
        self.groups = conv.groups
        self.in_channels = conv.in_channels
        self.out_channels = conv.out_channels
        layout_input = [1, conv.in_channels, 1, _LAYOUT_LENGTH]
        self.packed = torch.ops.mkldnn._reorder_convolution_weight(
            weight.unsqueeze(2), self.padding, self.stride, self.dilation, self.groups, layout_input
        )
        bias = None if conv.bias is None else conv.bias.detach()
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: (B, C_in, T) float32 -> (B, C_out, T') float32."""
        y: torch.Tensor = torch.ops.mkldnn._convolution_pointwise(
            x.unsqueeze(2), self.packed, self.bias, self.padding, self.stride, self.dilation, self.groups,
            "none", [], "",
        )  # fmt: skip
        return y.squeeze(2)

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, float32 packed for oneDNN"


def conv_packing_available() -> bool:
    """Whether this torch and CPU run oneDNN's float32 convolution on packed weights: the
    ops exist and give ``nn.Conv1d``'s result, to float32 rounding, on a small case."""
    try:
        if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]  # untyped in torch
            return False
        gen = torch.Generator().manual_seed(0)
        probe = nn.Conv1d(8, 4, 3, padding=2, dilation=2)
        x = torch.randn(1, 8, 20, generator=gen)
        with torch.no_grad():
            return bool(torch.allclose(PackedConv1d(probe)(x), probe(x), rtol=1e-5, atol=1e-6))
    except (AttributeError, RuntimeError) as exc:
        reason = type(exc).__name__
        logger.warning("oneDNN packed float32 convolutions are unavailable (%s); using nn.Conv1d", reason)
        return False


def pack_conv1ds_(module: nn.Module) -> int:
    """Replace every float32 CPU ``nn.Conv1d`` under ``module`` by a :class:`PackedConv1d`
    in place; returns how many. Nothing changes where :func:`conv_packing_available` says
    no. The packed copies take the place of the weights, which are dropped."""
    if not conv_packing_available():
        return 0
    targets = [
        (parent, name, child)
        for parent in module.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Conv1d and _float32_on_cpu(child.weight)
    ]
    with torch.no_grad():
        for parent, name, conv in targets:
            setattr(parent, name, PackedConv1d(conv))
    return len(targets)


def _float32_on_cpu(weight: torch.Tensor) -> bool:
    return weight.dtype == torch.float32 and weight.device.type == "cpu"
