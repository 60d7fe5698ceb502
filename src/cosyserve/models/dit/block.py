"""One DiT layer (upstream ``DiTBlock``): time-modulated self-attention and a tanh-GELU
feed-forward, each added back through a time-dependent gate."""

from collections.abc import Sequence

import torch.nn.functional as F
from torch import Tensor, nn

from cosyserve.models.dit.attention import DiTAttention
from cosyserve.models.dit.cache import FrameCache
from cosyserve.models.dit.modulation import BlockModulation, modulate


class DiTBlock(nn.Module):
    def __init__(self, dim: int, heads: int, head_dim: int, ff_mult: int, layer: int) -> None:
        super().__init__()
        self.modulation: nn.Module = BlockModulation(dim)  # released: a placeholder
        self.attn = DiTAttention(dim, heads, head_dim, layer)
        self.ff_in = nn.Linear(dim, dim * ff_mult)
        self.ff_out = nn.Linear(dim * ff_mult, dim)

    def forward(
        self,
        x: Tensor,
        modulation: Sequence[Tensor],
        angles: Tensor,
        mask: Tensor | None,
        cache: FrameCache | None,
    ) -> Tensor:
        """``x``: ``(B, T, D)``; ``modulation``: this layer's six vectors from the time
        embedding (:class:`BlockModulation`); ``angles``, ``mask``, ``cache``: as for
        :class:`DiTAttention`. Returns ``(B, T, D)``."""
        attn_shift, attn_scale, attn_gate, ff_shift, ff_scale, ff_gate = modulation
        x = x + attn_gate.unsqueeze(1) * self.attn(modulate(x, attn_shift, attn_scale), angles, mask, cache)
        hidden = F.gelu(self.ff_in(modulate(x, ff_shift, ff_scale)), approximate="tanh")
        ff: Tensor = self.ff_out(hidden)
        return x + ff_gate.unsqueeze(1) * ff
