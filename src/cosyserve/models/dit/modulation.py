"""Adaptive layer norms of the DiT (upstream ``AdaLayerNormZero`` and
``AdaLayerNormZero_Final``): a parameter-free LayerNorm whose scale and shift, and the
residual gates, come from the time embedding."""

from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor, nn

NORM_EPS = 1e-6


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    """``LayerNorm(x) * (1 + scale) + shift``; ``x``: ``(B, T, D)``, ``shift``/``scale``:
    ``(B, D)`` or ``(1, D)``."""
    normed = F.layer_norm(x, (x.shape[-1],), eps=NORM_EPS)
    return normed * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


@dataclass(frozen=True, eq=False)
class TimeConditioning:
    """What a DiT pass takes from its time embedding: each layer's six vectors
    (:class:`BlockModulation`), then the final norm's scale and shift
    (:class:`FinalModulation`); ``(B, D)`` each, where ``B`` = 1 serves any batch."""

    blocks: tuple[tuple[Tensor, ...], ...]
    final: tuple[Tensor, Tensor]


class BlockModulation(nn.Module):
    """Time embedding ``(B, D)`` -> six ``(B, D)`` vectors: attention shift, scale, gate,
    then feed-forward shift, scale, gate."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, 6 * dim)

    def forward(self, time: Tensor) -> tuple[Tensor, ...]:
        return tuple(self.linear(F.silu(time)).chunk(6, dim=1))


class FinalModulation(nn.Module):
    """Time embedding ``(B, D)`` -> the last norm's ``(scale, shift)``, ``(B, D)`` each
    (applied with :func:`modulate`)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, 2 * dim)

    def forward(self, time: Tensor) -> tuple[Tensor, Tensor]:
        scale, shift = self.linear(F.silu(time)).chunk(2, dim=1)
        return scale, shift
