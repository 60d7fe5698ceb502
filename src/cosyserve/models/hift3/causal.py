"""Causal convolutions run step by step, and the causal Snake residual block.

Every convolution of the CosyVoice 3 vocoder reads only the past, or a fixed number of
frames of the future. Each is run by :func:`conv_step` over the frames it has not seen yet,
joined to a :class:`Context`: the frames of earlier steps that later outputs still read.
One step over a whole input, or many steps over its pieces, give the same outputs; a
convolution's starting context is what upstream pads the start of a signal with (zeros for
the causal convolutions, nothing for the look-ahead ones, which instead wait for their
future frames, or at the end get zeros for them).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cosyserve.models.hift.resblock import Snake


@dataclass
class Context:
    """The input frames a convolution still needs from earlier steps: (B, C, n)."""

    frames: Tensor

    @staticmethod
    def zeros(batch: int, channels: int, width: int, like: Tensor) -> "Context":
        return Context(like.new_zeros(batch, channels, width))


def receptive_span(conv: nn.Conv1d) -> int:
    """Input frames one output of ``conv`` reads."""
    return conv.dilation[0] * (conv.kernel_size[0] - 1) + 1


def conv_step(conv: nn.Conv1d, x: Tensor, context: Context, weight: Tensor | None = None) -> Tensor:
    """Run ``conv`` (unpadded) over ``context.frames`` followed by ``x``: (B, C_in, n) ->
    (B, C_out, m), one output per complete window; ``context`` keeps the frames later
    windows read. Computes in ``x``'s dtype (the f0 predictor runs in float64), with
    ``weight`` instead of the convolution's own when given."""
    joined = torch.cat([context.frames, x], dim=2) if context.frames.shape[2] else x
    stride, span = conv.stride[0], receptive_span(conv)
    count = (joined.shape[2] - span) // stride + 1 if joined.shape[2] >= span else 0
    context.frames = joined[:, :, count * stride :].clone()
    if count == 0:
        return joined.new_zeros(joined.shape[0], conv.out_channels, 0)
    bias = None if conv.bias is None else conv.bias.to(joined.dtype)
    used = joined[:, :, : (count - 1) * stride + span]
    weight = conv.weight if weight is None else weight
    return F.conv1d(used, weight.to(joined.dtype), bias, stride, 0, conv.dilation)


def causal_context(conv: nn.Conv1d, batch: int, like: Tensor) -> Context:
    """The zeros a left-causal convolution sees before the first frame."""
    return Context.zeros(batch, conv.in_channels, receptive_span(conv) - 1, like)


class _CausalUnit(nn.Module):
    """Snake -> dilated causal conv -> Snake -> causal conv, plus the input."""

    def __init__(self, channels: int, kernel_size: int, dilation: int) -> None:
        super().__init__()
        self.snake1 = Snake(channels)
        self.conv1 = nn.Conv1d(channels, channels, kernel_size, dilation=dilation)
        self.snake2 = Snake(channels)
        self.conv2 = nn.Conv1d(channels, channels, kernel_size)

    def step(self, x: Tensor, contexts: tuple[Context, Context]) -> Tensor:
        y = conv_step(self.conv1, self.snake1(x), contexts[0])
        y = conv_step(self.conv2, self.snake2(y), contexts[1])
        return y.add_(x)  # y is the convolution's own new tensor


class CausalResBlock(nn.Module):
    """CosyVoice 2's Snake residual block (parameter names included) with left-causal
    convolutions: one unit per dilation, in sequence."""

    def __init__(self, channels: int, kernel_size: int, dilations: tuple[int, ...]) -> None:
        super().__init__()
        self.units = nn.ModuleList(_CausalUnit(channels, kernel_size, d) for d in dilations)

    def new_state(self, batch: int, like: Tensor) -> list[tuple[Context, Context]]:
        return [
            (causal_context(u.conv1, batch, like), causal_context(u.conv2, batch, like))
            for u in self._units()
        ]

    def step(self, x: Tensor, state: list[tuple[Context, Context]]) -> Tensor:
        """``x``: (B, C, n) new frames -> (B, C, n)."""
        for unit, contexts in zip(self._units(), state, strict=True):
            x = unit.step(x, contexts)
        return x

    def _units(self) -> list[_CausalUnit]:
        return [u for u in self.units if isinstance(u, _CausalUnit)]
