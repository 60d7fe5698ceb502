"""Scaled dot-product attention for the flow's attention layers, fast in bfloat16 on CPU.

On a CPU without AMX, torch's CPU flash-attention kernel runs bfloat16 no faster than
float32, while a bfloat16 batched GEMM of the same scores runs at about 3x float32's rate.
So bfloat16 there computes the two GEMMs and the softmax apart, which takes an estimator
layer's attention about 40 % less time. With AMX tiles the fused kernel is the faster
one, at the same error (the plan's ``fused_bf16_attention``, passed as ``fused_bf16``).
float32, and every CUDA dtype, always keep torch's fused kernel (``docs/precision.md``,
"How each choice works").

What it costs: the scores are rounded to bfloat16 before the softmax, where the fused kernel
keeps them in float32. On the full-size random model this does not change the flow's
error against float32, not even with attention made 4x sharper: the bfloat16 rounding of
every activation dominates. ``docs/precision.md`` has the bf16 flow's error and the
command that measures it.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

# Score elements computed at once (32 MiB in bfloat16): longer inputs run in query blocks,
# so a long or widely batched sequence never holds its whole score matrix.
MAX_SCORES = 1 << 24
# The fused bfloat16 kernel's calls without a bias get keys padded to a multiple of this
# (:func:`whole_key_rows`).
KEY_MULTIPLE = 16


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None = None,
    scale: float | None = None,
    fused_bf16: bool = False,
) -> Tensor:
    """``softmax(q·kᵀ · scale + bias) · v``.

    ``q``: ``(B, H, T, d)``; ``k``, ``v``: ``(B, H, K, d)``; ``bias``: additive, broadcast
    to ``(B, H, T, K)`` (a large negative value hides a key), or None; ``scale``: default
    ``1/√d``; ``fused_bf16``: bfloat16 on a CPU takes torch's fused kernel too. Returns
    ``(B, H, T, d)``.
    """
    if q.dtype == torch.bfloat16 and q.device.type == "cpu" and not fused_bf16:
        return split_attention(q, k, v, bias, scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)


def pads_keys(x: Tensor, bias: Tensor | None, fused_bf16: bool) -> bool:
    """Whether an attention layer's input ``x`` is padded by :func:`whole_key_rows`: in
    bfloat16 on a CPU on torch's fused kernel (``fused_bf16``), in calls without a bias of their
    own (a non-streaming request's flow). Padding a stream's calls, which carry one, would
    cost its chunks time and memory."""
    return bias is None and x.dtype == torch.bfloat16 and x.device.type == "cpu" and fused_bf16


def whole_key_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """``x`` (B, T, C) padded with zero rows to a multiple of :data:`KEY_MULTIPLE`, and a
    bias (1, 1, 1, T') in ``x``'s dtype that hides the padding (-inf) and nothing else.

    torch's bfloat16 CPU kernel (AMX) runs some key counts (multiples of 16 among them) fast
    and others up to several times slower; padded with the bias, the slow lengths run as
    fast as the fast ones. A layer's input is padded rather than its keys and values:
    projected, the zero rows are zero keys and values, and one copy of C channels replaces
    two of the inner width each (slightly faster, the same bits). The attention's queries
    are the first T rows. Sizes are computed with tensor ops, so a trace recorded at one
    length pads every other length right."""
    rows = x.shape[1]
    pad = (-rows) % KEY_MULTIPLE
    bias = torch.zeros_like(x[:1, :, 0])  # (1, T)
    bias = F.pad(bias, (0, pad), value=float("-inf"))
    return F.pad(x, (0, 0, 0, pad)), bias[:, None, None]  # (B, T', C), (1, 1, 1, T')


def split_attention(
    q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None = None, scale: float | None = None
) -> Tensor:
    """:func:`attention` as two GEMMs and a softmax apart (bfloat16 on CPUs without AMX)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    # The GEMMs take a dense batch of matrices as it is (or transposed) but copy a strided
    # one (heads split from a projection, a cache buffer with room) by a slow transposing
    # gather: copying it dense first is faster (about a quarter for a 50-frame incremental
    # layer over 400 cached frames; no difference for a whole non-streaming flow).
    keys = k.contiguous().transpose(-2, -1)  # (B, H, d, K)
    v = v.contiguous()
    size = q.shape[-2]
    rows = max(1, MAX_SCORES // (q.shape[0] * q.shape[1] * k.shape[-2]))
    if rows >= size:
        return _attend(q, keys, v, bias, scale)
    blocks = []
    for start in range(0, size, rows):
        block_bias = None if bias is None else bias[..., start : start + rows, :]
        blocks.append(_attend(q[..., start : start + rows, :], keys, v, block_bias, scale))
    return torch.cat(blocks, dim=-2)


def _attend(q: Tensor, keys: Tensor, v: Tensor, bias: Tensor | None, scale: float) -> Tensor:
    """One block of queries ``q`` ``(B, H, T, d)``, ``keys`` transposed ``(B, H, d, K)``.

    The GEMM scales the scores as it writes them (``alpha``), sparing a pass over the
    queries: with the flow's scale of 1/8 the same bits as scaling the queries first (a
    power of two), and one rounding fewer otherwise."""
    batch, heads, size, dim = q.shape
    flat_keys = keys.reshape(batch * heads, dim, keys.shape[-1])  # a view: keys are dense
    scores = torch.baddbmm(
        q.new_zeros(()), q.reshape(batch * heads, size, dim), flat_keys, beta=0, alpha=scale
    ).view(batch, heads, size, -1)  # (B, H, T, K)
    if bias is not None:
        scores = scores + bias
    out: Tensor = torch.softmax(scores, dim=-1) @ v
    return out
