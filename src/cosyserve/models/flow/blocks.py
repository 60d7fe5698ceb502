"""Building blocks of the flow-matching estimator: causal convolution blocks with
time conditioning and pre-norm transformer blocks.

Behaviour follows upstream ``cosyvoice/flow/decoder.py`` (``CausalBlock1D``,
``CausalResnetBlock1D``) and Matcha-TTS ``BasicTransformerBlock`` with diffusers'
``Attention`` (``matcha/models/components/transformer.py``).
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cosyserve.models.flow.attention import attention, pads_keys, whole_key_rows
from cosyserve.models.flow.stream_cache import LayerStates
from cosyserve.models.linear import linear_on, linear_rows, stacked_linear
from cosyserve.models.packed_linear import PackedLinear, packing_available

# Output rows (batch x frames) up to which a convolution without packed weights runs as one
# matrix product over its unfolded input. A stream's chunk through the estimator is 20 rows
# (10 frames, both CFG branches), where the product is faster than torch's CPU
# convolution (up to 2x); from about 100 rows on the two are even, and at 900 rows (a
# non-streaming request) the convolution is the faster. Packed weights (:func:`pack_convs_`)
# always run as the product.
GEMM_CONV_ROWS = 64


def conv1d(conv: nn.Conv1d, x: Tensor) -> Tensor:
    """``conv`` (stride 1, no padding, dilation 1, one group, as every flow convolution)
    over ``x`` ``(B, C_in, L)`` -> ``(B, C_out, L - k + 1)``.

    Where :func:`runs_as_matmul` says so it is one matrix product over the input's frames
    ``k`` at a time: with packed weights (``conv.gemm``, see :func:`pack_convs_`) over
    :func:`tap_windows` of the input's rows, else over the input unfolded channel by
    channel, with the convolution's own weight viewed as ``(C_out, C_in * k)`` (no copy of
    the weight). The output is then a transposed view of ``(B, T, C_out)``."""
    batch, channels, length = x.shape
    kernel = conv.kernel_size[0]
    frames = length - kernel + 1
    if not runs_as_matmul(conv, batch, frames):
        y: Tensor = conv(x)
        return y
    gemm = packed_gemm(conv)
    if gemm is not None:
        out: Tensor = gemm(tap_windows(x.transpose(1, 2), kernel))
    else:
        # (B, C, T, k) -> (B, T, C, k): column c * k + j holds input channel c at shift j, as
        # the weight's (C_out, C_in, k) layout flattens.
        columns = x.unfold(2, kernel, 1).transpose(1, 2).reshape(batch * frames, channels * kernel)
        out = F.linear(columns, conv.weight.view(conv.out_channels, channels * kernel), conv.bias)
    return out.view(batch, frames, conv.out_channels).transpose(1, 2)


def tap_windows(rows: Tensor, kernel: int) -> Tensor:
    """``rows`` ``(B, L, C)`` (one row of channels per frame) -> ``(B * T, kernel * C)``
    with ``T = L - kernel + 1``: row ``t`` holds frames ``t .. t + kernel - 1`` one after
    another (column ``j * C + c`` is channel ``c`` of frame ``t + j``), as a packed
    convolution weight is laid out (:func:`pack_convs_`).

    Each window is ``kernel`` whole rows of the input, so on contiguous rows this is
    ``kernel`` copies of contiguous runs, where unfolding ``(B, C, L)`` channel by channel
    gathers every element on its own, which makes a 900-row convolution of 256 channels
    about 1.4x slower."""
    if kernel == 1:
        return rows.reshape(-1, rows.shape[2])
    frames = rows.shape[1] - kernel + 1
    return torch.cat([rows[:, tap : tap + frames] for tap in range(kernel)], dim=2).flatten(0, 1)


def runs_as_matmul(conv: nn.Conv1d, batch: int, frames: int) -> bool:
    """Whether :func:`conv1d` runs ``conv`` over ``batch`` rows of ``frames`` output frames
    as one matrix product rather than as a convolution: always with packed weights (see
    :func:`pack_convs_`), else up to :data:`GEMM_CONV_ROWS` output rows."""
    return packed_gemm(conv) is not None or batch * frames <= GEMM_CONV_ROWS


def packed_gemm(conv: nn.Conv1d) -> PackedLinear | None:
    """``conv``'s weight packed tap by tap (set by :func:`pack_convs_`), or None."""
    gemm = getattr(conv, "gemm", None)
    return gemm if isinstance(gemm, PackedLinear) else None


def pack_convs_(module: nn.Module) -> int:
    """Give every bfloat16 CPU ``nn.Conv1d`` under ``module`` a ``gemm``: its weight laid
    out tap by tap, ``(C_out, k * C_in)`` with column ``j * C_in + c`` the weight of input
    channel ``c`` at tap ``j`` (the order :func:`tap_windows` gives), packed for oneDNN
    (:class:`PackedLinear`). :func:`conv1d` then runs every input through it: the same
    products as the convolution, summed in another order. The packed copy is kept beside
    the weight: 12 MiB on the full model's estimator. A stream's first chunk (46 short
    convolutions in each of 10 Euler steps) no longer reorders the weights on every call. A
    non-streaming flow's 900-row convolutions run as the product too, a few percent faster
    than torch's convolution on an AMX CPU, and their outputs come out as ``(B, T, C)``,
    which the layer norms and transformer blocks after them read without a copy. Returns
    how many; none where :func:`packing_available` says no."""
    if not packing_available():
        return 0
    convs = [m for m in module.modules() if isinstance(m, nn.Conv1d) and m.weight.dtype == torch.bfloat16]
    for conv in convs:
        by_tap = conv.weight.detach().permute(0, 2, 1).reshape(conv.out_channels, -1)  # (C_out, k * C_in)
        conv.gemm = PackedLinear(linear_on(by_tap, conv.bias))
    return len(convs)


def mish(x: Tensor) -> Tensor:
    """``x * tanh(softplus(x))``, computed in float32 and rounded once to ``x``'s dtype.

    With ``e = exp(x)``, ``tanh(log(1 + e)) = n / (n + 2)`` for ``n = e (e + 2)``: one
    exponential where torch's CPU kernel takes a softplus and a tanh, about 2.5x slower on
    a non-streaming flow's bfloat16 inputs. Inputs above 20 are clamped in the exponential
    only, where ``n / (n + 2)`` is already 1 in float32. Within torch's own error against float64."""
    f = x.float()
    e = f.clamp(max=20.0).exp()
    n = e * (e + 2.0)
    return (f * (n / (n + 2.0))).to(x.dtype)


def causal_conv(conv: nn.Conv1d, x: Tensor, states: LayerStates | None = None) -> Tensor:
    """Apply ``conv`` (no built-in padding) after left-padding ``kernel_size - 1`` zeros,
    so output frame ``t`` depends on input frames ``<= t`` only. ``(B, C, T)`` -> ``(B, C', T)``.

    With ``states`` (incremental streaming) the left padding is the cached input before
    ``x`` instead of zeros."""
    width = conv.kernel_size[0] - 1
    if states is None and packed_gemm(conv) is not None:
        # Padded as rows (B, T + width, C), the layout the packed product reads its windows
        # from: padding (B, C, T) would copy the frames into channel-major order only for
        # tap_windows to gather them back.
        return conv1d(conv, F.pad(x.transpose(1, 2), (0, 0, width, 0)).transpose(1, 2))
    padded = F.pad(x, (width, 0)) if states is None else states.left_pad(conv, x, width)
    return conv1d(conv, padded)


class CausalBlock(nn.Module):
    """Masked causal conv (kernel 3) -> LayerNorm over channels -> Mish, masked again."""

    def __init__(self, dim_in: int, dim_out: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(dim_in, dim_out, kernel_size=3)
        self.norm = nn.LayerNorm(dim_out)

    def forward(self, x: Tensor, mask: Tensor, states: LayerStates | None = None) -> Tensor:
        """``x``: ``(B, C_in, T)``; ``mask``: ``(B, 1, T)`` float. Returns ``(B, C_out, T)``."""
        h = causal_conv(self.conv, x * mask, states)
        h = self.norm(h.transpose(1, 2)).transpose(1, 2)
        return mish(h) * mask


class CausalResnetBlock(nn.Module):
    """Two causal blocks with the time embedding added in between, plus a 1x1 residual."""

    def __init__(self, dim_in: int, dim_out: int, time_dim: int) -> None:
        super().__init__()
        self.block1 = CausalBlock(dim_in, dim_out)
        self.time_proj = nn.Linear(time_dim, dim_out)
        self.block2 = CausalBlock(dim_out, dim_out)
        self.res_conv = nn.Conv1d(dim_in, dim_out, kernel_size=1)

    def forward(self, x: Tensor, mask: Tensor, time_emb: Tensor, states: LayerStates | None = None) -> Tensor:
        """``x``: ``(B, C_in, T)``; ``mask``: ``(B, 1, T)``; ``time_emb``: ``(B, time_dim)``.
        Returns ``(B, C_out, T)``."""
        h = self.block1(x, mask, states) + self.time_proj(mish(time_emb)).unsqueeze(-1)
        out: Tensor = self.block2(h, mask, states)
        residual = conv1d(self.res_conv, x * mask)
        return out + residual


class SelfAttention(nn.Module):
    """Multi-head self-attention; q/k/v without bias, the output projection with bias.
    The inner width ``heads * head_dim`` may differ from the model width."""

    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.heads = heads
        self.head_dim = head_dim
        inner = heads * head_dim
        self.q = nn.Linear(dim, inner, bias=False)
        self.k = nn.Linear(dim, inner, bias=False)
        self.v = nn.Linear(dim, inner, bias=False)
        self.out = nn.Linear(inner, dim)
        self.qkv: nn.Linear | None = None  # set by fuse_projections_
        self.kv: nn.Linear | None = None
        self.fused_bf16 = False  # set by Flow.use_fused_bf16_attention_

    def fuse_projections_(self) -> None:
        """Replace ``q``, ``k`` and ``v`` by ``qkv``, their rows stacked: one GEMM per call
        instead of three, with the same outputs, which takes a few percent off a stream's
        first chunk (132-row GEMMs). ``kv`` computes ``k`` and ``v`` alone, for
        :meth:`keys_values`: its weight is a view of ``qkv``'s rows, with no memory of its
        own until packing (``pack_linears_``) copies it."""
        self.qkv = stacked_linear(self.q, self.k, self.v)
        self.kv = linear_rows(self.qkv, self.heads * self.head_dim)
        del self.q, self.k, self.v

    def keys_values(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The keys and values of inputs ``x`` ``(B, T, C)``: ``(B, H, T, hd)`` each (a
        compact stream cache keeps the inputs and recomputes these, see ``LayerStates``)."""
        batch, size, _ = x.shape
        shape = (batch, size, self.heads, self.head_dim)
        projected = (self.k(x), self.v(x)) if self.kv is None else self.kv(x).chunk(2, dim=-1)
        k, v = (p.view(shape).transpose(1, 2) for p in projected)
        return k, v

    def forward(self, x: Tensor, bias: Tensor | None, states: LayerStates | None = None) -> Tensor:
        """``x``: ``(B, T, C)``; ``bias``: ``(B, 1, T, K)`` additive, or None to attend to
        every key. Returns ``(B, T, C)``.

        The keys are the queries (``K = T``; padded with hidden zero keys where
        :func:`~cosyserve.models.flow.attention.pads_keys`), or with ``states`` (incremental
        streaming) the ``states.length`` cached positions followed by ``x``'s."""
        batch, size, _ = x.shape
        if states is None and pads_keys(x, bias, self.fused_bf16):
            x, bias = whole_key_rows(x)  # zero rows: zero keys and values, hidden by the bias
        shape = (batch, -1, self.heads, self.head_dim)
        fused = self.qkv
        projected = (self.q(x), self.k(x), self.v(x)) if fused is None else fused(x).chunk(3, dim=-1)
        q, k, v = (p.view(shape).transpose(1, 2) for p in projected)  # (B, H, T', hd)
        if states is not None:
            k, v = states.attend(self, k, v, x)  # (B, H, K, hd)
        out = attention(q[:, :, :size], k, v, bias, fused_bf16=self.fused_bf16)
        y: Tensor = self.out(out.transpose(1, 2).reshape(batch, size, self.heads * self.head_dim))
        return y


class TransformerBlock(nn.Module):
    """Pre-norm self-attention then a GELU feed-forward (width x4), both residual."""

    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads, head_dim)
        self.ff_norm = nn.LayerNorm(dim)
        self.ff_in = nn.Linear(dim, 4 * dim)
        self.ff_out = nn.Linear(4 * dim, dim)

    def forward(self, x: Tensor, bias: Tensor | None, states: LayerStates | None = None) -> Tensor:
        """``x``: ``(B, T, C)``; ``bias``, ``states``: as for :class:`SelfAttention`.
        Returns ``(B, T, C)``."""
        attended: Tensor = x + self.attn(self.attn_norm(x), bias, states)
        normed = self.ff_norm(attended)
        # A packed Linear applies the GELU to its float32 sums (PackedLinear.gelu).
        ff_in = self.ff_in
        hidden = ff_in.gelu(normed) if isinstance(ff_in, PackedLinear) else F.gelu(ff_in(normed))
        ff: Tensor = self.ff_out(hidden)
        return attended + ff
