"""Conformer layers of the flow encoder: ESPnet relative-position self-attention
(Transformer-XL, arXiv:1901.02860 §3.3) in pre-norm blocks without convolution module.

Behaviour follows upstream ``cosyvoice/transformer/{attention,encoder_layer,embedding}.py``
(``rel_selfattn`` with ``rel_pos_espnet``, ``normalize_before=True``, no macaron).
"""

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cosyserve.models.flow.attention import attention
from cosyserve.models.flow.stream_cache import LayerStates

# Upstream's conformer LayerNorms use 1e-12 (ESPnet heritage), not torch's 1e-5.
_LAYER_NORM_EPS = 1e-12


def rel_position_embedding(
    size: int, dim: int, device: torch.device, dtype: torch.dtype, queries: int | None = None
) -> Tensor:
    """``(1, size + Q - 1, D)`` sinusoidal embedding of the relative positions
    ``size-1, ..., 0, ..., -(Q-1)``, for ``Q = queries`` (default ``size``) queries at the
    last ``Q`` of ``size`` key positions.

    Row ``m`` encodes the distance ``size-1-m`` (query minus key, positive when the key is
    to the left); even channels are sines, odd channels cosines.
    """
    queries = size if queries is None else queries
    positions = torch.arange(size - 1, -queries, -1, device=device, dtype=torch.float32)  # (size+Q-1,)
    freqs = torch.exp(
        torch.arange(0, dim, 2, device=device, dtype=torch.float32) * -(math.log(10000.0) / dim)
    )
    angles = positions.unsqueeze(1) * freqs.unsqueeze(0)  # (size+Q-1, D/2)
    table = torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(1)  # interleave: (size+Q-1, D)
    return table.unsqueeze(0).to(dtype)


def rel_shift(scores: Tensor) -> Tensor:
    """Turn ``(B, H, Q, K+Q-1)`` query-by-relative-position scores (rows as in
    :func:`rel_position_embedding` with ``size = K``) into ``(B, H, Q, K)`` query-by-key
    scores for queries at the last ``Q`` of ``K`` positions:
    ``out[..., i, j] = scores[..., i, Q-1-i+j]``.

    A strided view (no copy): each query row starts one element earlier in the
    relative axis than the row before it.
    """
    scores = scores.contiguous()
    batch, heads, queries, width = scores.shape
    keys = width - queries + 1
    s_batch, s_heads = scores.stride(0), scores.stride(1)
    return scores.as_strided(
        (batch, heads, queries, keys),
        (s_batch, s_heads, width - 1, 1),
        scores.storage_offset() + queries - 1,
    )


class RelPositionAttention(nn.Module):
    """Multi-head self-attention with relative positions:
    ``softmax(((q+u)·kᵀ + rel_shift((q+v)·pᵀ)) / √d_k) · v``."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = dim // heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)
        self.pos = nn.Linear(dim, dim, bias=False)
        self.fused_bf16 = False  # set by Flow.use_fused_bf16_attention_
        # Transformer-XL's u (content) and v (position) biases, per head.
        self.content_bias = nn.Parameter(torch.zeros(heads, self.head_dim))
        self.position_bias = nn.Parameter(torch.zeros(heads, self.head_dim))

    def forward(self, x: Tensor, mask: Tensor, pos_emb: Tensor, states: LayerStates | None = None) -> Tensor:
        """``x``: ``(B, T, D)``; ``mask``: ``(B, T, K)`` bool; ``pos_emb``: ``(1, K+T-1, D)``
        (:func:`rel_position_embedding` of ``K`` keys, ``T`` queries). Returns ``(B, T, D)``.

        Without ``states`` the keys are the queries (``K = T``). With ``states`` (incremental
        streaming) ``x`` holds the positions after the ``states.length`` cached ones, whose
        keys and values are reused: ``K = states.length + T``.
        """
        batch, size, dim = x.shape
        q = self.q(x).view(batch, size, self.heads, self.head_dim)
        k = self.k(x).view(batch, size, self.heads, self.head_dim).transpose(1, 2)  # (B, H, T, dk)
        v = self.v(x).view(batch, size, self.heads, self.head_dim).transpose(1, 2)
        if states is not None:
            k, v = states.attend(self, k, v)  # (B, H, K, dk)
        p = self.pos(pos_emb).view(1, -1, self.heads, self.head_dim).transpose(1, 2)  # (1, H, K+T-1, dk)
        q_content = (q + self.content_bias).transpose(1, 2)  # (B, H, T, dk)
        q_position = (q + self.position_bias).transpose(1, 2)
        scale = 1.0 / math.sqrt(self.head_dim)
        position_scores = rel_shift(q_position @ p.transpose(-2, -1)) * scale  # (B, H, T, K)
        # The position term enters as an additive bias, so the kernel computes the content term.
        bias = position_scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
        out = attention(q_content, k, v, bias, scale, fused_bf16=self.fused_bf16)
        y: Tensor = self.out(out.transpose(1, 2).reshape(batch, size, dim))
        return y


class FeedForward(nn.Module):
    """``Linear -> SiLU -> Linear`` (upstream's ``swish`` activation)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        y: Tensor = self.w2(F.silu(self.w1(x)))
        return y


class ConformerLayer(nn.Module):
    """Pre-norm ``x + attn(LN(x))`` then ``x + ffn(LN(x))``."""

    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(dim, eps=_LAYER_NORM_EPS)
        self.attn = RelPositionAttention(dim, heads)
        self.ff_norm = nn.LayerNorm(dim, eps=_LAYER_NORM_EPS)
        self.ff = FeedForward(dim, hidden)

    def forward(self, x: Tensor, mask: Tensor, pos_emb: Tensor, states: LayerStates | None = None) -> Tensor:
        """``x``: ``(B, T, D)``; ``mask``, ``pos_emb``, ``states``: as for :class:`RelPositionAttention`."""
        attended: Tensor = x + self.attn(self.attn_norm(x), mask, pos_emb, states)
        ff: Tensor = self.ff(self.ff_norm(attended))
        return attended + ff
