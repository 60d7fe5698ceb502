"""The flow-matching vector field (upstream ``CausalConditionalDecoder``): a 1-D U-Net
of causal resnet blocks and transformer blocks, conditioned on the time step.

With one channel level (the released ``channels: [256]``) the U-Net has no down- or
up-sampling: a down stage, ``num_mid_blocks`` mid stages and an up stage that takes the
down stage's output as a skip connection.
"""

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cosyserve.modeldir.hparams import EstimatorConfig
from cosyserve.models.flow.blocks import CausalBlock, CausalResnetBlock, TransformerBlock, causal_conv, conv1d
from cosyserve.models.flow.masks import attention_mask
from cosyserve.models.flow.stream_cache import LayerStates

# Additive attention bias of a masked key (upstream's ``mask_to_bias``).
_MASKED_BIAS = -1.0e10


def timestep_embedding(t: Tensor, dim: int) -> Tensor:
    """``(B,)`` times in [0, 1] -> ``(B, dim)`` sinusoidal features ``[sin, cos]`` of
    ``1000 t`` at ``dim/2`` geometric frequencies from 1 to 1/10000."""
    half = dim // 2
    freqs = torch.exp(
        torch.arange(half, device=t.device, dtype=torch.float32) * -(math.log(10000) / (half - 1))
    )
    angles = (1000 * t).unsqueeze(1) * freqs.unsqueeze(0)  # (B, half)
    return torch.cat([angles.sin(), angles.cos()], dim=-1).to(t.dtype)


class TimeMLP(nn.Module):
    """``Linear -> SiLU -> Linear`` on the sinusoidal time features."""

    def __init__(self, in_dim: int, dim: int) -> None:
        super().__init__()
        self.linear1 = nn.Linear(in_dim, dim)
        self.linear2 = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        y: Tensor = self.linear2(F.silu(self.linear1(x)))
        return y


class Stage(nn.Module):
    """One U-Net stage: a causal resnet block, then ``n_blocks`` transformer blocks."""

    def __init__(self, dim_in: int, dim: int, time_dim: int, cfg: EstimatorConfig) -> None:
        super().__init__()
        self.resnet = CausalResnetBlock(dim_in, dim, time_dim)
        self.transformers = nn.ModuleList(
            TransformerBlock(dim, cfg.num_heads, cfg.attention_head_dim) for _ in range(cfg.n_blocks)
        )

    def forward(
        self,
        x: Tensor,
        mask: Tensor,
        time_emb: Tensor,
        bias: Tensor | None,
        states: LayerStates | None = None,
    ) -> Tensor:
        """``x``: ``(B, C_in, T)`` -> ``(B, C, T)``; ``bias``: ``(B, 1, T, K)``."""
        h: Tensor = self.resnet(x, mask, time_emb, states).transpose(1, 2)  # (B, T, C)
        for block in self.transformers:
            h = block(h, bias, states)
        return h.transpose(1, 2)


class Estimator(nn.Module):
    """Predicts the flow velocity ``dx/dt`` for mel frames ``x`` at time ``t``."""

    def __init__(self, cfg: EstimatorConfig) -> None:
        super().__init__()
        (dim,) = cfg.channels  # one level only; Flow validates the configuration
        time_dim = 4 * dim
        self.in_channels = cfg.in_channels
        self.chunk_size = cfg.static_chunk_size
        self.time_mlp = TimeMLP(cfg.in_channels, time_dim)
        self.down = Stage(cfg.in_channels, dim, time_dim, cfg)
        self.down_conv = nn.Conv1d(dim, dim, kernel_size=3)
        self.mid = nn.ModuleList(Stage(dim, dim, time_dim, cfg) for _ in range(cfg.num_mid_blocks))
        self.up = Stage(2 * dim, dim, time_dim, cfg)
        self.up_conv = nn.Conv1d(dim, dim, kernel_size=3)
        self.final_block = CausalBlock(dim, dim)
        self.final_proj = nn.Conv1d(dim, cfg.out_channels, kernel_size=1)

    def attention_bias(self, mask: Tensor, streaming: bool, start: int = 0) -> Tensor | None:
        """``(B, 1, T, start + T)`` additive bias (0 or -1e10) for ``mask`` ``(B, 1, T)``
        float: padded keys are hidden, and future chunks of ``static_chunk_size`` frames
        too when streaming. ``start``: frames before ``mask``'s, cached while streaming
        incrementally. None when it hides nothing (a lone row without streaming): adding
        zeros costs the attention kernel ~10 %. Build it once per solve; it is the same for
        every step."""
        chunk = self.chunk_size if streaming else 0
        allowed = attention_mask(mask[:, 0] > 0, chunk, start)  # (B, T, start + T)
        if bool(allowed.all()):
            return None
        return ((1.0 - allowed.to(mask.dtype)) * _MASKED_BIAS).unsqueeze(1)

    def forward(
        self,
        x: Tensor,
        mask: Tensor,
        mu: Tensor,
        t: Tensor,
        spks: Tensor,
        cond: Tensor,
        bias: Tensor | None,
        states: LayerStates | None = None,
    ) -> Tensor:
        """Velocity at time ``t``.

        ``x``, ``mu``, ``cond``: ``(B, 80, T)``; ``mask``: ``(B, 1, T)`` float (1 = valid);
        ``t``: ``(B,)``; ``spks``: ``(B, 80)``; ``bias``: from :meth:`attention_bias`.
        ``states``: this Euler step's cached frames when streaming incrementally (``x``
        then holds the frames after them). Returns ``(B, 80, T)``, zero at padded frames.
        """
        time_emb = self.time_mlp(timestep_embedding(t, self.in_channels))  # (B, 4*C)
        spks = spks.unsqueeze(-1).expand(-1, -1, x.shape[2])
        h = torch.cat([x, mu, spks, cond], dim=1)  # (B, in_channels, T)

        skip = self.down(h, mask, time_emb, bias, states)
        h = causal_conv(self.down_conv, skip * mask, states)
        for stage in self.mid:
            h = stage(h, mask, time_emb, bias, states)
        h = self.up(torch.cat([h, skip], dim=1), mask, time_emb, bias, states)
        h = causal_conv(self.up_conv, h * mask, states)

        h = self.final_block(h, mask, states)
        out = conv1d(self.final_proj, h * mask)
        return out * mask
