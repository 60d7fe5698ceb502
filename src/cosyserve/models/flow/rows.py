"""Chunks of several requests through the flow in one call.

Each row has its own tokens, prompt, prompt mel and speaker embedding, of any lengths.
Rows are right-padded: the encoder zeroes the padding and places each row's look-ahead
context after its own end, attention hides padded keys, and every convolution after the
look-ahead is causal, so the padding never reaches a valid frame. Frame ``i`` of every
row draws noise column ``i``, as alone. Each row's output equals (up to float rounding)
what :meth:`Flow.inference` / :meth:`Flow.stream` give for it alone.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from cosyserve.models.flow.flow import Flow
from cosyserve.models.flow.masks import padding_mask
from cosyserve.models.flow.stacked import StackedCache
from cosyserve.models.flow.stream_cache import FlowStreamCache


@dataclass(frozen=True, eq=False)
class FlowRow:
    """One request's chunk: ``token`` ``(N,)`` generated tokens so far (look-ahead
    included unless final), ``prompt_token`` ``(P,)``, ``prompt_feat`` ``(P_mel, 80)``,
    ``embedding`` ``(spk_embed_dim,)``; ``offset``: generated tokens whose frames were
    emitted already (the output starts at frame ``P_mel + token_mel_ratio * offset``)."""

    token: Tensor
    prompt_token: Tensor
    prompt_feat: Tensor
    embedding: Tensor
    offset: int = 0


@torch.inference_mode()
def infer_rows(flow: Flow, rows: Sequence[FlowRow], *, streaming: bool, finalize: bool) -> list[Tensor]:
    """Per row, ``flow.inference(row..., streaming, finalize)[0, :, ratio * offset:]``:
    ``(80, T_b)`` float32 each, from one batched pass."""
    for row in rows:
        _check(flow, row, finalize)
    return _pass(flow, rows, None, streaming, finalize)


@torch.inference_mode()
def stream_rows(
    flow: Flow, caches: Sequence[FlowStreamCache], rows: Sequence[FlowRow], *, finalize: bool
) -> list[Tensor]:
    """Per row, ``flow.stream(cache_b, row..., offset_b, finalize)[0]`` (``(80, T_b)``
    float32) from one batched pass. Every cache must hold the same number of cached
    tokens (streams in lockstep); the rows' new token counts may differ.

    If the pass fails, every cache is left as it was (the pass can be run again)."""
    if len(caches) != len(rows) or not rows:
        raise ValueError(f"{len(caches)} caches for {len(rows)} rows")
    start = caches[0].tokens
    ratio, lookahead = flow.token_mel_ratio, 0 if finalize else flow.pre_lookahead_len
    for cache, row in zip(caches, rows, strict=True):
        _check(flow, row, finalize)
        if cache.finished:
            raise ValueError("this flow stream was finalized")
        if cache.tokens != start:
            raise ValueError("batched streams must hold the same number of cached tokens")
        if row.offset < 0 or row.prompt_feat.shape[0] + ratio * row.offset < ratio * start:
            raise ValueError(f"offset {row.offset} reaches into the frames already cached")
    totals = [row.prompt_token.shape[0] + row.token.shape[0] - lookahead for row in rows]
    out = [rows[0].prompt_feat.new_zeros(flow.cfg.output_size, 0, dtype=torch.float32) for _ in rows]
    # A row with no tokens after the cached ones (possible only when finalizing) has no pass.
    busy = [b for b, total in enumerate(totals) if total > start]
    for b, total in enumerate(totals):
        if b not in busy:
            caches[b].finish(total, finalize)
    if not busy:
        return out
    block = flow.stream_block
    committed = {b: totals[b] if finalize else totals[b] // block * block for b in busy}
    for b in busy:
        caches[b].begin(committed[b] - start, ratio)
    cache = caches[busy[0]] if len(busy) == 1 else StackedCache([caches[b] for b in busy])
    mels = _pass(flow, [rows[b] for b in busy], cache, True, finalize)
    for b, mel in zip(busy, mels, strict=True):
        caches[b].finish(committed[b], finalize)
        out[b] = mel
    return out


def _check(flow: Flow, row: FlowRow, finalize: bool) -> None:
    # Flow's own checks of one request's inputs, on the row as a batch of one.
    flow._check_inputs(
        row.token[None], row.prompt_token[None], row.prompt_feat[None], row.embedding[None], finalize
    )
    if row.offset < 0:
        raise ValueError(f"offset {row.offset} is negative")


def _pass(
    flow: Flow, rows: Sequence[FlowRow], cache: FlowStreamCache | None, streaming: bool, finalize: bool
) -> list[Tensor]:
    """One pass over the positions after ``cache``'s cached tokens (all, without a cache);
    each row's frames from its first output frame: ``(80, T_b)`` float32."""
    ratio, lookahead = flow.token_mel_ratio, 0 if finalize else flow.pre_lookahead_len
    start = 0 if cache is None else cache.tokens
    dtype = flow.speaker_proj.weight.dtype
    embedding = torch.stack([row.embedding for row in rows])  # (B, spk_embed_dim)
    spks = flow.speaker_proj(F.normalize(embedding.to(dtype), dim=1))  # (B, 80)
    tokens = [torch.cat([row.prompt_token, row.token])[start:] for row in rows]
    lengths = torch.tensor([t.shape[0] - lookahead for t in tokens], device=spks.device)  # (B,)
    x = flow.token_embedding(pad_sequence(tokens, batch_first=True).clamp(min=0))  # (B, T + look, D)
    context = None
    if lookahead:  # each row's look-ahead tokens, right after its own end
        index = lengths.unsqueeze(1) + torch.arange(lookahead, device=x.device)  # (B, look)
        context = x.gather(1, index.unsqueeze(2).expand(-1, -1, x.shape[2]))
    size = int(lengths.max())
    h, frames = flow.encoder(x[:, :size], lengths, context, streaming, cache)
    mu = flow.mu_proj(h).transpose(1, 2)  # (B, 80, ratio * size)

    cond = torch.zeros_like(mu)
    for b, row in enumerate(rows):
        prompt = row.prompt_feat[ratio * start :]  # the prompt frames among the new ones
        cond[b, :, : prompt.shape[0]] = prompt.transpose(0, 1).to(mu.dtype)
    mask = padding_mask(frames, mu.shape[2]).unsqueeze(1).to(mu.dtype)  # (B, 1, ratio * size)
    states = None if cache is None else cache.steps
    mel: Tensor = flow.cfm(mu, mask, spks, cond, streaming, states)  # (B, 80, ratio * size) float32
    return [
        mel[b, :, row.prompt_feat.shape[0] + ratio * (row.offset - start) : int(frames[b])]
        for b, row in enumerate(rows)
    ]
