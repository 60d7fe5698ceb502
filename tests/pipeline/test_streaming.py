"""Streaming guarantees of the whole pipeline on the tiny model.

Chunk sizes are predicted here from upstream's rule (CosyVoice2Model.tts, spec 7.1-7.2),
not from our ChunkSchedule: a first hop padded so that prompt + hop ends on a 25-token
block, 3 lookahead tokens, and a final chunk with the rest; the hop doubles after each
chunk up to 100 (upstream from ace7c47 on, the ``exact`` profile's schedule) or stays 25
(the older upstream's, the ``fast`` profile's). The vocoder holds back the last 8 mel
frames (3840 samples) of every non-final chunk for the cross-fade and the final chunk
releases them, so in samples a chunk of h tokens is
960 h - 3840 (first), 960 h (middle) or 960 h + 3840 (final).
"""

import dataclasses

import numpy as np
import pytest
import torch

from cosyserve.engine.loader import engine_config_for
from cosyserve.pipeline.request import Mode, SynthesisOptions, SynthesisRequest
from cosyserve.pipeline.synthesizer import Synthesizer
from cosyserve.pipeline.voice import VoicePrompt
from tests.pipeline.prompts import PROMPT_TOKENS

HOP, MAX_HOP, LOOKAHEAD, SAMPLES_PER_TOKEN, HELD_BACK = 25, 100, 3, 960, 3840


def upstream_hops(prompt: int, total: int, first_hop: int | None = None, grow: bool = True) -> list[int]:
    """Tokens emitted by each chunk of a ``total``-token stream (upstream's loop, its hop
    doubling up to 100 with ``grow``, else a constant 25; ``first_hop`` cuts the first
    chunk early and the next one re-aligns to the 25-token block grid, as documented for
    SynthesisOptions.first_hop)."""
    hops: list[int] = []
    offset, hop_now = 0, HOP
    while True:
        to_boundary = -(prompt + offset) % HOP
        if offset == 0:
            hop = HOP + to_boundary
            if first_hop is not None:
                hop = min(hop, first_hop)
        else:
            hop = to_boundary or hop_now
        if total - offset < hop + LOOKAHEAD:
            return [*hops, total - offset]
        hops.append(hop)
        offset += hop
        hop_now = min(MAX_HOP, 2 * hop_now) if grow else HOP


def expected_sizes(hops: list[int]) -> list[int]:
    sizes = [h * SAMPLES_PER_TOKEN for h in hops]
    if len(sizes) > 1:
        sizes[0] -= HELD_BACK
        sizes[-1] += HELD_BACK
    return sizes


def test_upstream_hops_helper_matches_the_spec_example() -> None:
    # 20 prompt tokens: the first hop is 25 + 5 so that 20 + 30 ends on a block boundary.
    assert upstream_hops(20, 60, grow=False) == [30, 25, 5]
    assert upstream_hops(0, 60, grow=False) == [25, 25, 10]
    assert upstream_hops(20, 36, first_hop=10, grow=False) == [10, 20, 6]
    assert upstream_hops(20, 32) == [32]  # fewer than hop + lookahead tokens: one final chunk
    # Growing: 30, then 50, then 100 at a time.
    assert upstream_hops(20, 60) == [30, 30]
    assert upstream_hops(20, 300) == [30, 50, 100, 100, 20]


def _tokens(n: int, seed: int) -> tuple[int, ...]:
    return tuple(torch.randint(0, 6561, (n,), generator=torch.Generator().manual_seed(seed)).tolist())


def _given_tokens(voice: VoicePrompt, n: int, **opts: int) -> SynthesisRequest:
    """A zero-shot request with its speech tokens given (no LM)."""
    return SynthesisRequest(
        "", Mode.ZERO_SHOT, voice, speech_tokens=_tokens(n, seed=3), options=SynthesisOptions(seed=5, **opts)
    )


def _lm_request(voice: VoicePrompt, n: int, stream: bool = True) -> SynthesisRequest:
    opts = SynthesisOptions(seed=11, min_tokens=n, max_tokens=n)
    return SynthesisRequest("Streaming, twice.", Mode.ZERO_SHOT, voice, stream=stream, options=opts)


@pytest.fixture(scope="module")
def constant_hop(synth: Synthesizer) -> Synthesizer:
    """The same model with the ``fast`` profile's constant 25-token hop."""
    return Synthesizer(synth.model, engine_config_for(synth.model, max_active=1, hop_growth=False))


@pytest.mark.parametrize(("grow", "sizes"), [(True, [24960, 32640]), (False, [24960, 24000, 8640])])
def test_streamed_chunks_follow_upstream_and_add_up_to_the_non_streamed_length(
    synth: Synthesizer, constant_hop: Synthesizer, voice: VoicePrompt, grow: bool, sizes: list[int]
) -> None:
    engine = synth if grow else constant_hop
    request = _given_tokens(voice, 60)
    whole = engine.synthesize(request)
    chunks = list(engine.stream(dataclasses.replace(request, stream=True)))
    assert [c.size for c in chunks] == expected_sizes(upstream_hops(PROMPT_TOKENS, 60, grow=grow)) == sizes
    assert sum(c.size for c in chunks) == whole.size == 60 * SAMPLES_PER_TOKEN
    streamed = np.concatenate(chunks)
    assert np.isfinite(streamed).all()
    # Nothing lost or doubled at the joins: every region of the stream carries signal.
    blocks = streamed.reshape(-1, SAMPLES_PER_TOKEN)
    assert (blocks.std(axis=1) > 1e-3).all()


def test_a_short_first_hop_cuts_early_then_realigns(synth: Synthesizer, voice: VoicePrompt) -> None:
    request = dataclasses.replace(_given_tokens(voice, 36, first_hop=10), stream=True)
    chunks = list(synth.stream(request))
    assert (
        [c.size for c in chunks]
        == expected_sizes(upstream_hops(PROMPT_TOKENS, 36, 10))
        == [5760, 19200, 9600]
    )


@pytest.fixture(scope="module")
def consecutive(synth: Synthesizer, voice: VoicePrompt) -> list[list[np.ndarray]]:
    """The same LM-driven streaming request, run twice in a row on one synthesizer."""
    return [list(synth.stream(_lm_request(voice, 60))) for _ in range(2)]


def test_consecutive_streams_chunk_identically(consecutive: list[list[np.ndarray]]) -> None:
    """Regression: upstream doubled its shared hop (25 -> 50 -> 100) during a stream and
    never reset it, so a second stream in the same process chunked differently."""
    first, second = consecutive
    assert (
        [c.size for c in first]
        == [c.size for c in second]
        == expected_sizes(upstream_hops(PROMPT_TOKENS, 60))
    )
    assert all(np.array_equal(a, b) for a, b in zip(first, second, strict=True))


def _run_together(synth: Synthesizer, requests: list[SynthesisRequest]) -> list[list[np.ndarray]]:
    """Step one engine with every request in it at once; each request's chunks in order."""
    ids = [f"concurrent-{i}" for i in range(len(requests))]
    for request_id, request in zip(ids, requests, strict=True):
        synth.engine.add(synth.frontend.build_spec(request, request_id))
    chunks: dict[str, list[np.ndarray]] = {i: [] for i in ids}
    batch_sizes = set()
    while synth.engine.has_work():
        for out in synth.engine.step():
            assert out.error is None
            if out.audio is not None and out.audio.size:
                chunks[out.request_id].append(out.audio)
        batch_sizes.add(synth.engine.stats.last_decode_batch)
    assert len(requests) in batch_sizes  # the LM really decoded them as one batch
    return [chunks[i] for i in ids]


def test_concurrent_streams_chunk_identically(
    synth: Synthesizer, voice: VoicePrompt, consecutive: list[list[np.ndarray]]
) -> None:
    """Two streams in one engine (two KV slots, both stepped, their chunks batched) chunk
    exactly like a stream alone, and give its audio up to the float rounding of a batched
    call: chunk cursors and vocoder caches are per request."""
    together = Synthesizer(synth.model, engine_config_for(synth.model, max_active=2))
    both = _run_together(together, [_lm_request(voice, 60), _lm_request(voice, 60)])
    alone = consecutive[0]
    for chunks in both:
        assert [c.size for c in chunks] == [c.size for c in alone]
        assert all(np.abs(a - b).max() <= 1e-4 for a, b in zip(chunks, alone, strict=True))
    assert together.engine.stats.flow_rows > together.engine.stats.flow_calls  # really batched


def test_stopping_the_iteration_aborts_the_request(synth: Synthesizer, voice: VoicePrompt) -> None:
    stream = synth.stream(_lm_request(voice, 60))
    first = next(stream)
    assert first.size == expected_sizes(upstream_hops(PROMPT_TOKENS, 60))[0]
    assert synth.engine.has_work()
    stream.close()
    assert not synth.engine.has_work()
    assert synth.engine.lm_runner.cache.free_slots == synth.engine.config.max_active
