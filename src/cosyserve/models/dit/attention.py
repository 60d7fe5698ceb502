"""The DiT's self-attention (upstream ``Attention`` with ``AttnProcessor``): biased
q/k/v/out projections, rotary position on the first head only (see
:mod:`cosyserve.models.dit.rotary`), optional cached keys/values of earlier frames."""

import torch.nn.functional as F
from torch import Tensor, nn

from cosyserve.models.dit.cache import FrameCache
from cosyserve.models.dit.rotary import rotate_first_head


class DiTAttention(nn.Module):
    """Multi-head self-attention over frames, with biases on every projection."""

    def __init__(self, dim: int, heads: int, head_dim: int, layer: int) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = head_dim
        self.layer = layer  # index of its keys/values in a StepCache
        inner = heads * head_dim
        self.q = nn.Linear(dim, inner)
        self.k = nn.Linear(dim, inner)
        self.v = nn.Linear(dim, inner)
        self.out = nn.Linear(inner, dim)

    def forward(self, x: Tensor, angles: Tensor, mask: Tensor | None, cache: FrameCache | None) -> Tensor:
        """``x``: ``(B, T, dim)``; ``angles``: ``(T, head_dim)`` rotary angles of the frames'
        absolute positions; ``mask``: ``(T, K)`` bool (True = may attend) or None for all
        keys; ``cache``: keys/values of the ``K - T`` frames before these, or None.
        Returns ``(B, T, dim)``."""
        batch, frames, _ = x.shape
        shape = (batch, frames, self.heads, self.head_dim)
        q = rotate_first_head(self.q(x).view(shape).transpose(1, 2), angles)  # (B, H, T, d)
        k = rotate_first_head(self.k(x).view(shape).transpose(1, 2), angles)
        v = self.v(x).view(shape).transpose(1, 2)
        if cache is not None:
            k, v = cache.attend(self.layer, k, v)  # (B, H, K, d)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y: Tensor = self.out(out.transpose(1, 2).reshape(batch, frames, self.heads * self.head_dim))
        return y
