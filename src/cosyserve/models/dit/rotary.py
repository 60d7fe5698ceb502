"""Rotary position embedding of the DiT's attention (x-transformers' ``RotaryEmbedding``
with ``apply_rotary_pos_emb``, as upstream's ``AttnProcessor`` applies them).

Upstream rotates the projected queries and keys *before* splitting them into heads, with
tables as wide as one head: so only the first head's channels are rotated, the other heads
carry no position at all. Channels rotate in adjacent pairs ``(2i, 2i + 1)`` by angle
``position * base^(-2i / head_dim)``.
"""

import torch
from torch import Tensor, nn

ROPE_BASE = 10000.0


class Rotary(nn.Module):
    """Angle tables for positions; the inverse frequencies are a persistent buffer
    (``inv_freq``, in ``flow.pt``)."""

    inv_freq: Tensor

    def __init__(self, head_dim: int) -> None:
        super().__init__()
        exponents = torch.arange(0, head_dim, 2).float() / head_dim
        self.register_buffer("inv_freq", 1.0 / (ROPE_BASE**exponents))

    def angles(self, start: int, length: int) -> Tensor:
        """``(length, head_dim)`` float32 angles of positions ``start .. start + length - 1``,
        each frequency repeated for both channels of its pair."""
        positions = torch.arange(start, start + length, device=self.inv_freq.device).float()
        freqs = positions.unsqueeze(1) * self.inv_freq.float().unsqueeze(0)  # (T, head_dim / 2)
        return freqs.repeat_interleave(2, dim=1)


def rotate_first_head(x: Tensor, angles: Tensor) -> Tensor:
    """Rotate head 0 of ``x`` ``(B, H, T, d)`` by ``angles`` ``(T, d)``; the other heads
    pass unchanged. Computed in float32, returned in ``x``'s dtype."""
    head = x[:, :1].float()  # (B, 1, T, d)
    pairs = head.view(*head.shape[:-1], -1, 2)
    swapped = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)  # (-x_odd, x_even)
    rotated = head * angles.cos() + swapped * angles.sin()
    return torch.cat([rotated.to(x.dtype), x[:, 1:]], dim=1)
