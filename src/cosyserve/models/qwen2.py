"""The Qwen2 decoder stack (Qwen2.5-0.5B geometry in CosyVoice 2), reading and writing a
multi-sequence :class:`~cosyserve.models.kv_cache.KVCache`.

Numerics follow Hugging Face's Qwen2: RMSNorm computed in float32, RoPE with the
``rotate_half`` convention (the two halves of each head, not interleaved pairs) and
cos/sin computed in float32, grouped-query attention with biased q/k/v projections and an
unbiased output projection, SwiGLU MLP, and a final RMSNorm. Only the body is here: the
151,936-way text head is never needed to generate speech tokens.
"""

import torch
import torch.nn.functional as F
from torch import nn

from cosyserve.modeldir.hparams import Qwen2Config
from cosyserve.models.embedding import embedding
from cosyserve.models.kv_cache import KVStep
from cosyserve.models.linear import stacked_linear
from cosyserve.models.span_attention import attention_bias, runs_span_attention, span_attention


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: (..., H) of any float dtype; normalised in float32, returned in ``x``'s dtype."""
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        out: torch.Tensor = self.weight * x32.to(x.dtype)
        return out


class RotaryEmbedding(nn.Module):
    """cos/sin tables of rotary position embedding, computed per step from positions.

    The frequencies are recomputed on each call rather than held in a buffer, which
    ``model.half()`` would round: angles are always float32, as in Hugging Face.
    """

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions``: (B, T) long. Returns the tables :func:`apply_rotary` takes, each
        (B, T, 1, D) in ``dtype``: cos, and sin with its first half negated."""
        exponents = torch.arange(0, self.head_dim, 2, device=positions.device).float() / self.head_dim
        inv_freq = 1.0 / (self.theta**exponents)  # (D/2,)
        freqs = positions[..., None].float() * inv_freq  # (B, T, D/2)
        sin = freqs.sin()
        cos = torch.cat((freqs, freqs), dim=-1).cos()
        # rotate_half(x) * sin == cat(x2, x1) * cat(-sin, sin), bit for bit: the sign moves
        # from x to the table, computed once per step instead of per layer.
        signed_sin = torch.cat((-sin, sin), dim=-1)
        return cos[:, :, None].to(dtype), signed_sin[:, :, None].to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (B, T, heads, D) by the tables of :class:`RotaryEmbedding` (B, T, 1, D):
    Hugging Face's ``x * cos + rotate_half(x) * sin``."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x * cos + swapped * signed_sin


class Attention(nn.Module):
    def __init__(self, cfg: Qwen2Config, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=True)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.qkv_proj: nn.Linear | None = None  # set by fuse_projections_

    def fuse_projections_(self) -> None:
        """Replace ``q_proj``, ``k_proj`` and ``v_proj`` by ``qkv_proj``, their rows stacked:
        one GEMM per call instead of three (int8 dynamic quantization does this first, so
        each call also quantizes its input once; see :mod:`cosyserve.accel.quantize`)."""
        self.qkv_proj = stacked_linear(self.q_proj, self.k_proj, self.v_proj)
        del self.q_proj, self.k_proj, self.v_proj

    def _project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated q (B, T, heads, D), rotated k and v (B, T, kv_heads, D) of ``x`` (B, T, H)."""
        b, t, _ = x.shape
        if self.qkv_proj is None:
            q = apply_rotary(self.q_proj(x).view(b, t, self.num_heads, self.head_dim), cos, sin)
            k = apply_rotary(self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim), cos, sin)
            return q, k, self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        stacked: torch.Tensor = self.qkv_proj(x)
        # q and k heads are adjacent in the stacked output: one rotation covers both.
        rotated_heads = self.num_heads + self.num_kv_heads
        width = rotated_heads * self.head_dim
        qk = apply_rotary(stacked[..., :width].view(b, t, rotated_heads, self.head_dim), cos, sin)
        v = stacked[..., width:].view(b, t, self.num_kv_heads, self.head_dim)
        return qk[:, :, : self.num_heads], qk[:, :, self.num_heads :], v

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        bias: torch.Tensor,
        step: KVStep | None,
    ) -> torch.Tensor:
        """``x``: (B, T, H); ``cos``, ``sin``: from :class:`RotaryEmbedding`; ``bias``: from
        :func:`attention_bias`, (B or 1, 1, T, S') with S' the keys padded to whole blocks.
        With ``step`` the new keys and values go into the cache and the queries see the
        slot's whole history (S positions); without, they see only ``x`` (S = T)."""
        b, t, _ = x.shape
        q, k, v = self._project(x, cos, sin)
        if step is None:
            keys, values = k.transpose(1, 2), v.transpose(1, 2)  # (B, H_kv, T, D)
        else:
            keys, values = step.update(self.layer, k, v)  # (B, H_kv, S, D)
        q = q.transpose(1, 2)  # (B, heads, T, D)
        if runs_span_attention(q.device):
            out = span_attention(q, keys, values, bias, in_order=step is not None and step.decode)
        else:
            out = F.scaled_dot_product_attention(
                q, keys.to(q.dtype), values.to(q.dtype), attn_mask=bias[..., : keys.shape[2]], enable_gqa=True
            )  # (B, heads, T, D)
        result: torch.Tensor = self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))
        return result


class MLP(nn.Module):
    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up_proj: nn.Linear | None = None  # set by fuse_projections_

    def fuse_projections_(self) -> None:
        """Replace ``gate_proj`` and ``up_proj`` by ``gate_up_proj``, their rows stacked (as
        :meth:`Attention.fuse_projections_`)."""
        self.gate_up_proj = stacked_linear(self.gate_proj, self.up_proj)
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            hidden = F.silu(self.gate_proj(x)) * self.up_proj(x)
        else:
            # Views of the stacked projection's own new output: the product is written over
            # its gate half instead of into fresh memory (the same bits).
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            hidden = F.silu(gate, inplace=True).mul_(up)
        out: torch.Tensor = self.down_proj(hidden)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen2Config, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        bias: torch.Tensor,
        step: KVStep | None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, bias, step)
        out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


class Qwen2Model(nn.Module):
    """Token embedding, decoder layers and final norm of a Qwen2 model (no LM head)."""

    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)

    def forward(self, x: torch.Tensor, step: KVStep | None = None) -> torch.Tensor:
        """Run input embeddings ``x`` (B, T, H) through the stack; returns (B, T, H) after
        the final norm (Hugging Face's ``hidden_states[-1]``).

        With ``step`` (from :meth:`KVCache.begin` for these B slots and T positions, or
        another :class:`KVStep`) the tokens continue their slots' sequences; the caller
        commits the step afterwards.
        Without, each row is a whole sequence starting at position 0 (causal attention).
        """
        t = x.shape[1]
        if step is None:
            positions = torch.arange(t, device=x.device)[None]  # (1, T)
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()[None, None]  # (1, 1, T, T)
        else:
            positions, mask = step.positions, step.mask
        cos, sin = self.rotary(positions, x.dtype)
        bias = attention_bias(mask, torch.float32 if runs_span_attention(x.device) else x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, bias, step)
        out: torch.Tensor = self.norm(x)
        return out
