"""The causal F0 predictor (upstream's CausalConvRNNF0Predictor): log-mel -> pitch in Hz,
each frame reading ``LOOK_AHEAD`` frames of the future.

Upstream runs it in float64 ("precision is crucial for causal inference"): the phase of the
harmonic source sums f0 over the whole stream, and that sum is rounded to float32 and
multiplied by 2π·480, so a difference in the last bits of f0 grows with the stream. Its
convolutions are weight-normalised and upstream makes their weights from (g, v) in float64
too; ours keep (g, v) as the checkpoint stores them (torch's weight-norm parametrization)
and make the weight in the dtype they run in, so that the weights, not only the arithmetic,
are upstream's.
"""

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.parametrizations import weight_norm

from cosyserve.models.hift.f0 import NUM_CONV_LAYERS
from cosyserve.models.hift3.causal import Context, causal_context, conv_step

# The first convolution (kernel 4) reads the frame and the next three; the rest (kernel 3) the past.
LOOK_AHEAD = 3
_KERNEL = 3


@dataclass
class F0State:
    """One stream's contexts: the look-ahead convolution's waiting frames, then the left
    context of each causal convolution."""

    contexts: list[Context]


class CausalF0Predictor(nn.Module):
    """(weight-normalised conv + ELU) x 5, a per-frame Linear to one value, ``abs``."""

    def __init__(self, in_channels: int, channels: int) -> None:
        super().__init__()
        widths = [in_channels] + [channels] * NUM_CONV_LAYERS
        kernels = [LOOK_AHEAD + 1] + [_KERNEL] * (NUM_CONV_LAYERS - 1)
        self.convs = nn.ModuleList(
            weight_norm(nn.Conv1d(c_in, c_out, k))
            for (c_in, c_out), k in zip(itertools.pairwise(widths), kernels, strict=True)
        )
        self.classifier = nn.Linear(channels, 1)

    def new_state(self, batch: int, like: Tensor) -> F0State:
        convs = self._convs()
        first = Context(like.new_zeros(batch, convs[0].in_channels, 0))  # waits for its future
        return F0State([first] + [causal_context(conv, batch, like) for conv in convs[1:]])

    def step(self, mel: Tensor, state: F0State, *, final: bool) -> Tensor:
        """``mel``: (B, n_mels, n) new frames -> f0 (B, m) in Hz, >= 0, for every frame whose
        look-ahead has arrived; ``final`` gives the last frames zeros as their future.
        Computes in ``mel``'s dtype, weights included."""
        if final:
            mel = F.pad(mel, (0, LOOK_AHEAD))
        x = mel
        for conv, context in zip(self._convs(), state.contexts, strict=True):
            x = F.elu(conv_step(conv, x, context, weight=normed_weight(conv, x.dtype)))
        weight, bias = self.classifier.weight.to(x.dtype), self.classifier.bias.to(x.dtype)
        f0 = F.linear(x.transpose(1, 2), weight, bias).squeeze(-1)  # (B, m, C) -> (B, m)
        return torch.abs(f0)

    def _convs(self) -> list[nn.Conv1d]:
        return [c for c in self.convs if isinstance(c, nn.Conv1d)]


def normed_weight(conv: nn.Module, dtype: torch.dtype) -> Tensor:
    """``g * v / ||v||`` of a weight-norm parametrised convolution, computed in ``dtype``
    from (g, v) in that dtype: what the parametrization gives after ``.to(dtype)``."""
    parametrization = conv.get_submodule("parametrizations.weight")
    g = parametrization.get_parameter("original0").to(dtype)
    v = parametrization.get_parameter("original1").to(dtype)
    weight: Tensor = parametrization.get_submodule("0")(g, v)
    return weight
