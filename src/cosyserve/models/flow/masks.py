"""Attention masks shared by the flow encoder and estimator.

Masks are boolean with ``True`` meaning "may attend"; they are built explicitly from
per-row lengths so that a batch of requests of different lengths can share one call.
"""

import torch
from torch import Tensor


def padding_mask(lengths: Tensor, max_len: int) -> Tensor:
    """``(B, T)`` bool, ``True`` at the first ``lengths[b]`` positions of row ``b``.

    ``lengths``: ``(B,)`` integer. Lengths beyond ``max_len`` mark the whole row valid.
    """
    positions = torch.arange(max_len, device=lengths.device)
    return positions.unsqueeze(0) < lengths.unsqueeze(1)


def chunk_mask(size: int, chunk_size: int, device: torch.device | None = None, start: int = 0) -> Tensor:
    """``(T - start, T)`` bool block-causal mask: query position ``i`` (``start <= i < T``)
    sees ``[0, (i // chunk_size + 1) * chunk_size)``.

    Chunks are counted from position 0, which for the flow is the start of the prompt,
    not of the generated tokens. ``start > 0`` gives the rows of the positions after
    ``start`` only (incremental streaming, where earlier positions are cached).
    """
    keys = torch.arange(size, device=device)
    queries = keys[start:]
    chunk_end = (queries // chunk_size + 1) * chunk_size  # (T - start,) exclusive end per query
    return keys.unsqueeze(0) < chunk_end.unsqueeze(1)


def attention_mask(valid: Tensor, chunk_size: int, start: int = 0) -> Tensor:
    """``(B, T, start + T)`` bool self-attention mask: valid keys only, and block-causal
    when ``chunk_size > 0`` (streaming) or full attention when it is 0.

    ``valid``: ``(B, T)`` bool padding mask of the queries, which are positions
    ``start, ..., start + T - 1``; the ``start`` keys before them (cached while streaming
    incrementally) are all valid. Padded query rows keep their valid keys, so no row is
    empty and softmax stays finite.
    """
    batch, size = valid.shape
    if start:
        valid = torch.cat([valid.new_ones(batch, start), valid], dim=1)
    keys = valid.unsqueeze(1).expand(batch, size, start + size)  # (B, T_query, T_key)
    if chunk_size <= 0:
        return keys
    return keys & chunk_mask(start + size, chunk_size, valid.device, start).unsqueeze(0)
