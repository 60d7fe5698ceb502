"""Prefix reuse: what is restored is what was computed, the pool stays bounded, and the
engine's output is the same with and without it."""

import dataclasses

import torch

from cosyserve.bench.engine_runs import make_engine, run_together, voices
from cosyserve.bench.workload import synthetic_spec, synthetic_text_ids
from cosyserve.engine.loader import LoadedModel
from cosyserve.engine.request import GenerationSpec
from cosyserve.modeldir.presets import TINY
from cosyserve.models.kv_cache import KVCache
from cosyserve.models.prefix_cache import PrefixCache, lm_input_ids
from tests.engine.helpers import assert_same

QWEN = TINY.lm.qwen


def filled(cache: KVCache, n: int, seed: int) -> int:
    """A slot holding n positions of random keys and values."""
    slot = cache.allocate()
    gen = torch.Generator().manual_seed(seed)
    layers, _, heads, _, head_dim = cache.k.shape
    k = torch.randn(layers, n, heads, head_dim, generator=gen)
    cache.load_prefix(slot, k, torch.randn(k.shape, generator=gen))
    return slot


def test_restore_gives_back_the_stored_whole_blocks() -> None:
    cache = KVCache.for_config(QWEN, 3, 64)
    prefix = PrefixCache.for_config(QWEN, 64, block_size=4)
    ids = lm_input_ids((5, 6, 7, 8, 9), (1, 2, 3, 4, 5, 6))  # 13 positions: 3 whole blocks
    source = filled(cache, 13, seed=0)
    prefix.store(ids, cache, source)
    assert len(prefix) == 3
    target = cache.allocate()
    assert prefix.restore(ids, cache, target, limit=len(ids) - 1) == 12
    assert torch.equal(cache.k[:, target, :, :12], cache.k[:, source, :, :12])
    assert torch.equal(cache.v[:, target, :, :12], cache.v[:, source, :, :12])
    assert cache.length(target) == 12
    cache.free(target)
    target = cache.allocate()
    assert prefix.restore(ids, cache, target, limit=11) == 8  # whole blocks within the limit
    cache.free(target)
    # Same text after another voice's prompt text: the first block differs, nothing matches.
    other = lm_input_ids((4, 6, 7, 8, 9), (1, 2, 3, 4, 5, 6))
    target = cache.allocate()
    assert prefix.restore(other, cache, target, limit=len(other)) == 0 and cache.length(target) == 0
    # Text and speech ids never alias each other.
    assert lm_input_ids((3,), ()) != lm_input_ids((), (3,))
    assert prefix.stats.lookups == 3 and prefix.stats.hits == 2 and prefix.stats.reused_positions == 20


def test_the_pool_is_bounded_and_recycled_least_recently_used_first() -> None:
    cache = KVCache.for_config(QWEN, 2, 64)
    prefix = PrefixCache.for_config(QWEN, 40, block_size=4)  # 10 blocks
    pool = (prefix.k.data_ptr(), prefix.nbytes)
    voice = (100, 101, 102)  # with sos: one whole block shared by every input below
    slot = filled(cache, 32, seed=1)
    for text in range(20):
        prefix.store(lm_input_ids((*voice, 1000 + text, 7, 7, 7), (5, 5, 5, 5)), cache, slot)
        assert len(prefix) <= prefix.max_blocks
    assert (prefix.k.data_ptr(), prefix.nbytes) == pool
    assert prefix.stats.evicted_blocks > 0
    target = cache.allocate()
    # The shared first block was touched by every input: it survived all the evictions.
    assert prefix.restore(lm_input_ids((*voice, 5, 5, 5, 5), ()), cache, target, limit=64) == 4
    cache.free(target)
    target = cache.allocate()
    last = lm_input_ids((*voice, 1019, 7, 7, 7), (5, 5, 5, 5))
    assert prefix.restore(last, cache, target, limit=64) == 12
    cache.free(target)
    target = cache.allocate()
    first = lm_input_ids((*voice, 1000, 7, 7, 7), (5, 5, 5, 5))
    assert prefix.restore(first, cache, target, limit=64) == 4  # only the voice block is left
    prefix.clear()
    assert len(prefix) == 0


def waves(model: LoadedModel) -> list[list[GenerationSpec]]:
    """Three waves of requests on three voices: new texts, other new texts, then the
    second wave again."""
    vs = voices(model)

    def wave(tag: str, seed: int) -> list[GenerationSpec]:
        return [
            synthetic_spec(
                f"{tag}-{i}",
                vs[i % 3],
                synthetic_text_ids(model.hparams, 16, seed=seed + i),
                tokens=12 + i,
                seed=seed + i,
                stream=i % 2 == 1,
            )
            for i in range(6)
        ]

    second = wave("b", 200)
    return [
        wave("a", 100),
        second,
        [dataclasses.replace(s, request_id="c" + s.request_id[1:]) for s in second],
    ]


def test_engine_output_is_the_same_with_and_without_reuse(tiny_model: LoadedModel) -> None:
    with_reuse = make_engine(tiny_model, max_active=4)
    without = make_engine(tiny_model, max_active=4, prefix_cache_positions=0)
    prefix = with_reuse.prefix_cache
    assert prefix is not None and without.prefix_cache is None
    reused = []
    for wave in waves(tiny_model):
        before = prefix.stats.reused_positions
        got, want = run_together(with_reuse, wave), run_together(without, wave)
        assert_same(got, want, [s.request_id for s in wave])
        reused.append(prefix.stats.reused_positions - before)
    # The first wave's later requests reuse their voice's [sos] + prompt text (one whole
    # block of 4: 4 or 5 prompt text ids); the repeated wave reuses almost everything.
    assert reused[0] > 0 and reused[1] >= 6 * 4
    repeated = waves(tiny_model)[2]
    inputs = sum(
        len(lm_input_ids(s.lm_prefix_ids + s.segments[0].text_ids, s.lm_prompt_speech)) for s in repeated
    )
    assert reused[2] >= inputs - 4 * len(repeated)
    assert without.stats.prefill_tokens - with_reuse.stats.prefill_tokens == sum(reused)
