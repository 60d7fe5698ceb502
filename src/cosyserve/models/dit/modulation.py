"""Adaptive layer norms of the DiT (upstream ``AdaLayerNormZero`` and
``AdaLayerNormZero_Final``): a parameter-free LayerNorm whose scale and shift, and the
residual gates, come from the time embedding."""

import torch.nn.functional as F
from torch import Tensor, nn

NORM_EPS = 1e-6


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    """``LayerNorm(x) * (1 + scale) + shift``; ``x``: ``(B, T, D)``, ``shift``/``scale``:
    ``(B, D)``."""
    normed = F.layer_norm(x, (x.shape[-1],), eps=NORM_EPS)
    return normed * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class BlockModulation(nn.Module):
    """Time embedding ``(B, D)`` -> six ``(B, D)`` vectors: attention shift, scale, gate,
    then feed-forward shift, scale, gate."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, 6 * dim)

    def forward(self, time: Tensor) -> tuple[Tensor, ...]:
        return tuple(self.linear(F.silu(time)).chunk(6, dim=1))


class FinalModulation(nn.Module):
    """The last norm: ``LayerNorm(x) * (1 + scale) + shift`` with ``(scale, shift)`` from
    the time embedding (scale first)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, 2 * dim)

    def forward(self, x: Tensor, time: Tensor) -> Tensor:
        """``x``: ``(B, T, D)``; ``time``: ``(B, D)``."""
        scale, shift = self.linear(F.silu(time)).chunk(2, dim=1)
        return modulate(x, shift, scale)
