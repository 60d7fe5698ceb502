"""FlowPromptCache: a voice is primed once, later streams of it start from a fork, and
the cache stays within its bytes, least recently used voice out first."""

import pytest
import torch

from cosyserve.models.flow import Flow
from cosyserve.models.flow.prompt_cache import FlowPromptCache
from cosyserve.models.flow.stream_cache import FlowStreamCache
from tests.models.flow.test_flow_incremental import Voice

_TOL = 1e-5


def _cache(cache: FlowPromptCache, voice: Voice) -> FlowStreamCache:
    return cache.stream_cache(voice.prompt_token[0], voice.prompt_feat[0], voice.embedding[0])


def _primed_bytes(flow: Flow, voice: Voice) -> int:
    return flow.prime_stream(voice.prompt_token, voice.prompt_feat, voice.embedding).nbytes()


def test_a_voice_is_primed_once_and_its_streams_start_after_the_prefix(flow: Flow) -> None:
    voice = Voice(40, 60, seed=20)
    cache = FlowPromptCache(flow, max_bytes=1 << 30)
    first, second = _cache(cache, voice), _cache(cache, voice)
    assert (cache.stats.misses, cache.stats.hits, len(cache)) == (1, 1, 1)
    assert first.tokens == second.tokens == 25
    assert cache.nbytes == _primed_bytes(flow, voice) > 0
    want = [voice.incremental(flow, flow.new_stream_cache(), chunk) for chunk in voice.chunks(7)]
    for stream in (first, second):
        got = [voice.incremental(flow, stream, chunk) for chunk in voice.chunks(7)]
        assert all(float((a - b).abs().max()) <= _TOL for a, b in zip(got, want, strict=True))


def test_every_part_of_the_voice_is_in_the_key(flow: Flow) -> None:
    voice = Voice(40, 1, seed=21)
    cache = FlowPromptCache(flow, max_bytes=1 << 30)
    _cache(cache, voice)
    tokens, feat, embedding = voice.prompt_token[0], voice.prompt_feat[0], voice.embedding[0]
    other_tokens = tokens.clone()
    other_tokens[-1] = (tokens[-1] + 1) % 100  # a look-ahead token of the prefix
    other_feat = feat.clone()
    other_feat[0, 0] += 1e-3
    variants = [
        (other_tokens, feat, embedding),
        (tokens, other_feat, embedding),
        (tokens, feat, 2 * embedding),
    ]
    for variant in variants:
        cache.stream_cache(*variant)
    assert (cache.stats.misses, cache.stats.hits, len(cache)) == (4, 0, 4)


def test_prompts_without_a_voice_only_block_are_not_cached(flow: Flow) -> None:
    cache = FlowPromptCache(flow, max_bytes=1 << 30)
    for prompt in (0, 27):
        voice = Voice(prompt, 1, seed=prompt)
        stream = _cache(cache, voice)
        assert stream.tokens == 0 and stream.nbytes() == 0
    assert (cache.stats.misses, cache.stats.hits, len(cache), cache.nbytes) == (0, 0, 0, 0)


def test_eviction_by_bytes_least_recently_used_first(flow: Flow) -> None:
    voices = [Voice(30, 1, seed=30 + i) for i in range(4)]
    size = _primed_bytes(flow, voices[0])
    cache = FlowPromptCache(flow, max_bytes=2 * size + size // 2)  # room for two voices
    _cache(cache, voices[0])
    _cache(cache, voices[1])
    _cache(cache, voices[0])  # voice 1 is now the least recently used
    _cache(cache, voices[2])
    assert (len(cache), cache.nbytes, cache.stats.evictions) == (2, 2 * size, 1)
    hits = cache.stats.hits
    _cache(cache, voices[0])
    assert cache.stats.hits == hits + 1  # kept
    _cache(cache, voices[1])
    assert cache.stats.hits == hits + 1 and cache.stats.misses == 4  # evicted, primed again
    assert (len(cache), cache.nbytes, cache.stats.evictions) == (2, 2 * size, 2)


def test_a_voice_larger_than_the_cache_is_primed_but_not_kept(flow: Flow) -> None:
    voice = Voice(30, 60, seed=40)
    cache = FlowPromptCache(flow, max_bytes=_primed_bytes(flow, voice) - 1)
    stream = _cache(cache, voice)
    assert stream.tokens == 25
    assert (len(cache), cache.nbytes, cache.stats.misses) == (0, 0, 1)
    with pytest.raises(ValueError, match="positive"):
        FlowPromptCache(flow, max_bytes=0)


def test_a_flow_moved_to_another_dtype_does_not_reuse_its_old_states(flow: Flow) -> None:
    voice = Voice(30, 1, seed=41)
    copy = Flow(flow.cfg)
    copy.load_state_dict(flow.state_dict())
    cache = FlowPromptCache(copy.eval(), max_bytes=1 << 30)
    _cache(cache, voice)
    copy.to(torch.float64)
    assert _cache(cache, voice).tensors()[0].dtype == torch.float64
    assert (cache.stats.misses, cache.stats.hits) == (2, 0)
