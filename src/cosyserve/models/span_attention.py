"""The LM's attention, with each row's result independent of its batch and of how far
its batch reaches.

In a batched decode step every row reads the keys up to the batch's longest sequence and
masks the rest; in a prefill, a query's chunk decides how many keys its row sees. torch's
CPU attention kernel and one GEMM over all keys both sum in an order that depends on that
span, so a row's output moved by about 1e-7 with its neighbours' lengths: enough, under
dynamic int8 rounding, to move a full-size LM's log-probs by orders of magnitude more, so
that a request's speech tokens depended on what else the engine was running
(``docs/precision.md``, "How each choice works"). torch's kernel also gives a lone decode
row other bits than the same row in a batch at the same span, on some CPUs and data, in
float32 too.

So every CPU step attends with :func:`span_attention`. Every span is padded to whole blocks
of :data:`KEY_BLOCK` keys, the padding hidden by the mask; the keys are cut into blocks
from position 0, every sum runs within a block and then across blocks, and keys a row may
not see get weight exactly 0. Across blocks, prefill chunks sum by a tree aligned at block
0, and decode steps block by block in order (one op, whose count a traced step need not
know: one trace replays every span). Blocks past a row's last visible key then add exact
zeros and change nothing: a query's output is the same bits in any prefill chunk, and a
decode row's in any batch, over any span and on any number of threads.
:func:`runs_span_attention` says which runs where.
"""

import math

import torch
import torch.nn.functional as F

# Keys per block. Every span is padded to a multiple: 64 keeps a short decode's padding
# small, and a 64-key block is a shape the GEMMs handle at a fair rate.
KEY_BLOCK = 64
_LOG2_E = math.log2(math.e)
# Score elements per tile of queries (1 MiB of float32 scores).
_TILE_SCORES = 1 << 18


def runs_span_attention(device: torch.device) -> bool:
    """Whether the LM's layers attend with :func:`span_attention` (in float32, bias in
    float32) or torch's kernel (bias in the activations' dtype): CPUs take
    :func:`span_attention`, for prefill chunks, whole sequences and decode steps alike.
    GPUs keep torch's fused kernels, whose sums are their own."""
    return device.type == "cpu"


def padded_span(span: int) -> int:
    """``span`` rounded up to whole key blocks."""
    return -(-span // KEY_BLOCK) * KEY_BLOCK


def attention_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive bias of ``mask`` (B or 1, 1, T, S) bool, True where a key is visible:
    (B or 1, 1, T, S'), S' = :func:`padded_span` of S, 0 where visible and -inf elsewhere
    (on the padding too)."""
    span = mask.shape[-1]
    bias = torch.full((*mask.shape[:-1], padded_span(span)), float("-inf"), dtype=dtype, device=mask.device)
    bias[..., :span].masked_fill_(mask, 0.0)
    return bias


def span_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, in_order: bool = False
) -> torch.Tensor:
    """Grouped-query attention ``softmax(q·kᵀ/√D + bias)·v`` summed in key blocks.

    ``q``: (B, H, T, D); ``keys``, ``values``: (B, H_kv, S, D) with H a multiple of H_kv
    (query head h reads key head h // (H / H_kv)); ``bias``: (B or 1, 1, T, S') additive,
    S' = :func:`padded_span` of S, -inf on every key a query may not see and on keys
    S..S'. ``in_order``: sum across blocks in order rather than by a tree (decode steps;
    another order, so other bits than a prefill's). Returns (B, H, T, D) in ``q``'s dtype;
    computed in float32.
    """
    t, span, padded = q.shape[2], keys.shape[2], bias.shape[-1]
    if padded != padded_span(span):
        raise ValueError(f"a bias over {padded} keys does not pad a span of {span} to whole blocks")
    keys, values = keys.float(), values.float()
    if padded != span:
        keys = F.pad(keys, (0, 0, 0, padded - span))
        values = F.pad(values, (0, 0, 0, padded - span))
    # Long prefills run in tiles of queries, whose scores stay in cache: each query's
    # result is the same in any tile. A tile reads the blocks up to the last key any of its
    # queries sees (a causal chunk's early queries see fewer): the blocks after add zeros.
    tile = max(1, _TILE_SCORES // (q.shape[1] * padded))
    if t <= tile:
        return _attend(q, keys, values, bias, in_order)
    tiles = []
    for start in range(0, t, tile):
        part = bias[:, :, start : start + tile]
        seen = _blocks_seen(part)
        tiles.append(
            _attend(
                q[:, :, start : start + tile],
                keys[:, :, :seen],
                values[:, :, :seen],
                part[..., :seen],
                in_order,
            )
        )
    return torch.cat(tiles, dim=2)


def _blocks_seen(bias: torch.Tensor) -> int:
    """The keys of the blocks up to the last key some query of ``bias`` sees, their count
    rounded up to a power of two (what :func:`_tree_sum` pads to) within the span."""
    visible = (bias > float("-inf")).flatten(0, -2).any(0)  # (S',)
    blocks = int(visible.nonzero().max()) // KEY_BLOCK + 1 if bool(visible.any()) else 1
    return min(bias.shape[-1], KEY_BLOCK << (blocks - 1).bit_length())


def _attend(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, in_order: bool
) -> torch.Tensor:
    """:func:`span_attention` on float32 keys and values already padded to whole blocks."""
    b, heads, t, d = q.shape
    kv_heads, padded = keys.shape[1], keys.shape[2]
    group, blocks = heads // kv_heads, padded // KEY_BLOCK
    # Rows ordered (group member, query): the rows of one key head form one matrix. Its
    # GEMM sums a row's scores alike at any width, and at any height from 3 rows up (the
    # released model has 7 or more; the tests check both head geometries).
    rows = q.float().reshape(b, kv_heads, group * t, d)
    scores = torch.matmul(rows, keys.transpose(-1, -2))  # (B, H_kv, G*T, S')
    # Base-2 scores: exp2 is exact 0 at -inf and fast there, where exp (MKL's vector exp
    # on CPU) takes ten times as long on a hidden key as on a visible one.
    scores = torch.add(bias[:, :, None], scores.view(b, kv_heads, group, t, padded), alpha=d**-0.5 * _LOG2_E)
    weights = scores.sub_(scores.amax(dim=-1, keepdim=True)).exp2_()
    weights = weights.view(b, kv_heads, group * t, blocks, KEY_BLOCK)
    value_blocks = values.reshape(b, kv_heads, blocks, KEY_BLOCK, d)
    sum_blocks = _sum_in_order if in_order else _tree_sum
    num = sum_blocks(weights.transpose(2, 3) @ value_blocks, 2)  # (B, H_kv, G*T, D)
    den = sum_blocks(weights.sum(-1), 3)  # (B, H_kv, G*T)
    out = num / den[..., None]
    return out.view(b, kv_heads, group, t, d).reshape(b, heads, t, d).to(q.dtype)


def _tree_sum(partial: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum ``partial`` over its blocks along ``dim``, padded with zero blocks to a power of
    two and halved until one is left: trailing blocks of zeros change no sum."""
    blocks = partial.shape[dim]
    size = 1 << (blocks - 1).bit_length()
    if size != blocks:
        pad = [0, 0] * (partial.dim() - 1 - dim) + [0, size - blocks]
        partial = F.pad(partial, pad)
    while size > 1:
        size //= 2
        partial = partial.narrow(dim, 0, size) + partial.narrow(dim, size, size)
    return partial.squeeze(dim)


def _sum_in_order(partial: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum ``partial`` over its blocks along ``dim``, block by block from the first: torch's
    CPU cumsum runs along ``dim`` in order, so trailing blocks of zeros change no sum. One
    op whatever the count, so a decode step traced over 1 block replays any span; the
    tree's count of halvings is fixed when traced. For a decode step, summing in order
    costs less than a tree padded to the cache's capacity; for a prefill chunk it costs
    about a fifth more than the tree, so prefills keep the tree."""
    return partial.cumsum(dim).select(dim, -1)
