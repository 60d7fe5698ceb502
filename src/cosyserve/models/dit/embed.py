"""The DiT's input embeddings: the flow time (sinusoidal features through an MLP) and the
frames (noisy mel, prompt mel, token features and speaker, projected, plus a causal
convolutional position embedding). Upstream: ``TimestepEmbedding``, ``InputEmbedding``
and ``CausalConvPositionEmbedding`` of ``cosyvoice/flow/DiT``."""

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cosyserve.models.dit.cache import FrameCache

TIME_FEATURES = 256
TIME_SCALE = 1000.0
POS_KERNEL = 31
POS_GROUPS = 16


def sinusoidal_features(t: Tensor, dim: int = TIME_FEATURES) -> Tensor:
    """``t`` ``(B,)`` -> ``(B, dim)`` float32: ``[sin(1000 t f_i), cos(1000 t f_i)]`` with
    ``f_i = 10000^(-i / (dim/2 - 1))``."""
    half = dim // 2
    freqs = torch.exp(torch.arange(half, device=t.device).float() * -(math.log(10000) / (half - 1)))
    angles = TIME_SCALE * t.unsqueeze(1) * freqs.unsqueeze(0)
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class TimeEmbedding(nn.Module):
    """Flow time ``t`` ``(B,)`` -> ``(B, dim)``: sinusoidal features, Linear, SiLU, Linear."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear1 = nn.Linear(TIME_FEATURES, dim)
        self.linear2 = nn.Linear(dim, dim)

    def forward(self, t: Tensor) -> Tensor:
        features = sinusoidal_features(t).to(t.dtype)
        out: Tensor = self.linear2(F.silu(self.linear1(features)))
        return out


class InputEmbedding(nn.Module):
    """Frames -> DiT width: ``proj([x, cond, mu, spks])``, plus two grouped causal
    convolutions (kernel 31, each followed by Mish) of that projection."""

    def __init__(self, mel_dim: int, mu_dim: int, spk_dim: int, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(2 * mel_dim + mu_dim + spk_dim, dim)
        self.pos_conv1 = nn.Conv1d(dim, dim, POS_KERNEL, groups=POS_GROUPS)
        self.pos_conv2 = nn.Conv1d(dim, dim, POS_KERNEL, groups=POS_GROUPS)

    def forward(self, x: Tensor, cond: Tensor, mu: Tensor, spks: Tensor, cache: FrameCache | None) -> Tensor:
        """``x``, ``cond``: ``(B, T, mel_dim)``; ``mu``: ``(B, T, mu_dim)``; ``spks``:
        ``(B, spk_dim)``; ``cache``: the frames before these (their convolution inputs), or
        None at the start. Returns ``(B, T, dim)``."""
        speaker = spks.unsqueeze(1).expand(-1, x.shape[1], -1)
        h: Tensor = self.proj(torch.cat([x, cond, mu, speaker], dim=-1))  # (B, T, dim)
        pos = self._causal(self.pos_conv1, "pos_conv1", h.transpose(1, 2), cache)
        pos = self._causal(self.pos_conv2, "pos_conv2", pos, cache)
        return pos.transpose(1, 2) + h

    @staticmethod
    def _causal(conv: nn.Conv1d, name: str, x: Tensor, cache: FrameCache | None) -> Tensor:
        """``Mish(conv(x))`` over ``x`` ``(B, D, T)`` left-padded by ``kernel - 1`` cached
        inputs (zeros at the start)."""
        width = conv.kernel_size[0] - 1
        padded = F.pad(x, (width, 0)) if cache is None else cache.left_pad(name, x, width)
        out: Tensor = F.mish(conv(padded))
        return out
