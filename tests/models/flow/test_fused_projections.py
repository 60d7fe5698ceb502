"""Stacked q/k/v projections in the estimator's attention (``Flow.fuse_projections_``)."""

import copy

import pytest
import torch

from cosyserve.engine.chunking import ChunkSchedule
from cosyserve.models.flow import Flow
from cosyserve.models.flow.blocks import SelfAttention


# bfloat16 is emulated, and slow, on CPUs without its instructions: its case runs with the
# slow suite; float32 checks the same fusion.
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.slow)])
def test_fused_projections_give_the_same_mel_frames(flow: Flow, dtype: torch.dtype) -> None:
    separate = copy.deepcopy(flow).to(dtype)
    fused = copy.deepcopy(flow).to(dtype)
    fused.fuse_projections_()
    attentions = [m for m in fused.modules() if isinstance(m, SelfAttention)]
    assert attentions and all(m.qkv is not None and not hasattr(m, "q") for m in attentions)

    gen = torch.Generator().manual_seed(3)
    vocab, prompt = flow.cfg.vocab_size, 25
    voice = (
        torch.randint(0, vocab, (1, prompt), generator=gen),
        torch.randn(1, 2 * prompt, 80, generator=gen),
        torch.randn(1, 192, generator=gen),
    )
    tokens = torch.randint(0, vocab, (1, 60), generator=gen)
    for streaming in (False, True):
        want = separate.inference(tokens, *voice, streaming=streaming, finalize=True)
        assert torch.equal(fused.inference(tokens, *voice, streaming=streaming, finalize=True), want)
    # Compact caches recompute the history's keys and values with qkv's k/v rows, viewed.
    for m in attentions:
        assert m.kv is not None and m.qkv is not None
        assert m.kv.weight.untyped_storage().data_ptr() == m.qkv.weight.untyped_storage().data_ptr()
        assert torch.equal(m.kv.weight, m.qkv.weight[m.heads * m.head_dim :])
    models = separate, fused, fused
    caches = separate.new_stream_cache(), fused.new_stream_cache(), fused.new_stream_cache(compact=True)
    schedule = ChunkSchedule(prompt, first_hop=5)
    while (chunk := schedule.next_chunk(tokens.shape[1], finished=True)) is not None:
        want, *got = (
            model.stream(cache, tokens[:, : chunk.token_end], *voice, chunk.offset, chunk.finalize)
            for model, cache in zip(models, caches, strict=True)
        )
        assert all(torch.equal(g, want) for g in got), chunk
