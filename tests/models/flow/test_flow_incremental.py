"""Incremental streaming through the flow (``Flow.stream`` with a per-request
``FlowStreamCache``) against upstream's full recompute, and its use by Token2Wav."""

import gc
import weakref
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from cosyserve.engine.chunking import Chunk, ChunkSchedule
from cosyserve.engine.config import EngineConfig, FlowCacheMode
from cosyserve.engine.engine import Engine
from cosyserve.engine.request import GenerationSpec, Request, Segment, SegmentState, generators_for
from cosyserve.engine.stats import EngineStats
from cosyserve.engine.token2wav import ChunkWork, Token2Wav
from cosyserve.modeldir.presets import TINY
from cosyserve.models.flow import Flow
from cosyserve.models.flow.blocks import SelfAttention
from cosyserve.models.flow.stream_cache import FlowStreamCache, LayerStates
from cosyserve.models.hift.generator import HiFTGenerator
from cosyserve.models.lm import CosyVoice2LM
from cosyserve.weights.randomize import randomize_

_TOL = 1e-4
_NARROW_TOL = {torch.float16: 2e-3, torch.int8: 2e-2}  # narrower cached states (docs/precision.md)


@pytest.fixture(scope="module")
def hift() -> HiFTGenerator:
    model = HiFTGenerator(TINY.hift)
    randomize_(model, torch.Generator().manual_seed(1))
    return model.eval()


class Voice:
    """Random prompt tokens, prompt mel (2 frames per token), embedding and speech tokens."""

    def __init__(self, prompt: int, tokens: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        vocab = TINY.flow.vocab_size
        self.prompt_token = torch.randint(0, vocab, (1, prompt), generator=gen)
        self.prompt_feat = torch.randn(1, 2 * prompt, 80, generator=gen)
        self.embedding = torch.randn(1, 192, generator=gen)
        self.tokens = torch.randint(0, vocab, (1, tokens), generator=gen)

    def chunks(self, first_hop: int | None = None) -> Iterator[Chunk]:
        schedule = ChunkSchedule(self.prompt_token.shape[1], first_hop=first_hop)
        while (chunk := schedule.next_chunk(self.tokens.shape[1], finished=True)) is not None:
            yield chunk

    def exact(self, flow: Flow, chunk: Chunk, streaming: bool = True) -> torch.Tensor:
        """Upstream's chunk: every token so far recomputed, sliced after the emitted ones."""
        mel = flow.inference(
            self.tokens[:, : chunk.token_end],
            self.prompt_token,
            self.prompt_feat,
            self.embedding,
            streaming=streaming,
            finalize=chunk.finalize,
        )
        return mel[:, :, 2 * chunk.offset :]

    def incremental(self, flow: Flow, cache: FlowStreamCache, chunk: Chunk) -> torch.Tensor:
        return flow.stream(
            cache,
            self.tokens[:, : chunk.token_end],
            self.prompt_token,
            self.prompt_feat,
            self.embedding,
            chunk.offset,
            chunk.finalize,
        )


@pytest.mark.parametrize(
    ("prompt", "tokens", "first_hop"),
    [
        (13, 70, None),  # prompt + first hop padded to a block boundary (upstream)
        (25, 64, 5),  # a short first hop ends mid-block: that block is recomputed next time
        (40, 72, 30),  # first hop ends 20 tokens into a block
        (0, 58, 7),  # no prompt
    ],
)
@pytest.mark.parametrize("compact", [False, True])
def test_incremental_chunks_equal_the_exact_path(
    flow: Flow, prompt: int, tokens: int, first_hop: int | None, compact: bool
) -> None:
    voice = Voice(prompt, tokens, seed=prompt)
    cache = flow.new_stream_cache(compact)
    chunks = list(voice.chunks(first_hop))
    assert len(chunks) >= 3 and chunks[-1].finalize
    frames = 0
    for chunk in chunks:
        got = voice.incremental(flow, cache, chunk)
        # The final chunk is block-causal as well: streaming=True, finalize=True.
        want = voice.exact(flow, chunk)
        assert got.shape == want.shape and got.shape[2] > 0
        assert float((got - want).abs().max()) <= _TOL, chunk
        frames += got.shape[2]
        if not chunk.finalize:
            assert cache.tokens % flow.stream_block == 0
            assert cache.tokens <= prompt + chunk.token_end - TINY.flow.pre_lookahead_len
    assert frames == 2 * tokens
    assert cache.finished and cache.nbytes() == 0


@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize(
    ("dtype", "held", "saved"),
    [(torch.float16, {torch.float16}, (2, 2)), (torch.int8, {torch.int8, torch.float32}, (3, 4))],
)
def test_narrower_caches_stay_close_to_the_exact_path_in_less_memory(
    flow: Flow, compact: bool, dtype: torch.dtype, held: set[torch.dtype], saved: tuple[int, int]
) -> None:
    """A float32 flow's steps held in float16 or int8 rows: every chunk within
    docs/precision.md's tolerance of upstream's, the Euler steps' states in half the bytes
    (float16) or between a third and a quarter (int8: a scale per row besides the bytes)."""
    voice = Voice(25, 64, seed=3)
    wide, narrow = flow.new_stream_cache(compact), flow.new_stream_cache(compact, dtype)
    for chunk in voice.chunks(5):
        got = voice.incremental(flow, narrow, chunk)
        want = voice.exact(flow, chunk)
        assert float((got - want).abs().max()) <= _NARROW_TOL[dtype], chunk
        voice.incremental(flow, wide, chunk)
        if not chunk.finalize:
            assert {t.dtype for s in narrow.steps for t in s.tensors() if t.dim() == 4} == held
            steps = [sum(s.nbytes() for s in c.steps) - _contexts(c, c.steps) for c in (wide, narrow)]
            assert saved[0] * steps[1] <= steps[0] <= saved[1] * steps[1] and steps[0] > 0, chunk


def test_each_chunk_runs_the_estimator_over_its_new_frames_only(flow: Flow) -> None:
    voice = Voice(25, 130, seed=3)
    cache = flow.new_stream_cache()
    widths: list[int] = []
    hook = flow.cfm.estimator.register_forward_hook(lambda _m, args, _out: widths.append(args[0].shape[2]))
    try:
        per_chunk = []
        for chunk in voice.chunks():
            widths.clear()
            voice.incremental(flow, cache, chunk)
            assert len(set(widths)) == 1  # every Euler step the same frames
            per_chunk.append(widths[0])
    finally:
        hook.remove()
    # The prompt and first hop, then 25 new tokens per chunk, never the history again.
    assert per_chunk[:-1] == [100] + [50] * (len(per_chunk) - 2)
    assert per_chunk[-1] == 2 * (130 - 25 * (len(per_chunk) - 1))


def test_interleaved_streams_equal_each_stream_alone(flow: Flow) -> None:
    voices = [Voice(13, 60, seed=4), Voice(31, 60, seed=5)]
    hops = [None, 6]
    alone = []
    for voice, hop in zip(voices, hops, strict=True):
        cache = flow.new_stream_cache()
        alone.append([voice.incremental(flow, cache, chunk) for chunk in voice.chunks(hop)])

    caches = [flow.new_stream_cache() for _ in voices]
    streams = [list(voice.chunks(hop)) for voice, hop in zip(voices, hops, strict=True)]
    together: list[list[torch.Tensor]] = [[], []]
    for i in range(max(map(len, streams))):
        for v, voice in enumerate(voices):
            if i < len(streams[v]):
                together[v].append(voice.incremental(flow, caches[v], streams[v][i]))
    for got, want in zip(together, alone, strict=True):
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)


def test_the_final_chunk_differs_from_upstreams_full_attention_but_stays_close(flow: Flow) -> None:
    voice = Voice(25, 60, seed=6)
    cache = flow.new_stream_cache()
    *_, final = voice.chunks()
    for chunk in voice.chunks():
        got = voice.incremental(flow, cache, chunk)
    upstream = voice.exact(flow, final, streaming=False)
    deviation = float((got - upstream).abs().mean())
    assert 0 < deviation < 0.5 * float(upstream.abs().mean())


def test_a_finished_stream_cannot_continue_and_cached_frames_cannot_be_asked_for(flow: Flow) -> None:
    voice = Voice(25, 60, seed=7)
    cache = flow.new_stream_cache()
    first, second, *_ = voice.chunks()
    voice.incremental(flow, cache, first)
    assert cache.tokens == 50 and cache.nbytes() > 0
    behind = Chunk(token_end=second.token_end, offset=first.offset, finalize=False)
    with pytest.raises(ValueError, match="already cached"):
        voice.incremental(flow, cache, behind)
    voice.incremental(flow, cache, Chunk(token_end=60, offset=second.offset, finalize=True))
    with pytest.raises(ValueError, match="finalized"):
        voice.incremental(flow, cache, Chunk(token_end=60, offset=60, finalize=True))


# -- Token2Wav and the engine ---------------------------------------------------------------


def _request(voice: Voice, stream: bool, first_hop: int | None = None, seed: int = 9) -> Request:
    spec = GenerationSpec(
        request_id="r",
        segments=(Segment(speech_tokens=tuple(voice.tokens[0].tolist())),),
        embedding=voice.embedding[0],
        flow_prompt_tokens=voice.prompt_token[0],
        flow_prompt_mel=voice.prompt_feat[0],
        seed=seed,
        stream=stream,
        first_hop=first_hop,
    )
    schedule = ChunkSchedule(voice.prompt_token.shape[1], first_hop=first_hop)
    seg = SegmentState(spec.segments[0], schedule, None, tokens=list(voice.tokens[0].tolist()), lm_done=True)
    lm_gen, vocoder_gen = generators_for(seed)
    return Request(spec=spec, segments=[seg], lm_generator=lm_gen, vocoder_generator=vocoder_gen)


def _run(token2wav: Token2Wav, request: Request) -> tuple[list[np.ndarray], list[bool]]:
    """Audio per chunk, and whether the segment held a flow cache after each chunk."""
    seg = request.segments[0]
    audio, cached = [], []
    while (chunk := seg.schedule.peek(len(seg.tokens), finished=True)) is not None:
        (out,) = token2wav.run([ChunkWork(request, seg, chunk)])
        assert isinstance(out, np.ndarray)
        audio.append(out)
        cached.append(seg.flow_cache is not None)
        seg.schedule.advance(chunk)
        if not request.spec.stream:
            break
    return audio, cached


def test_token2wav_modes(flow: Flow, hift: HiFTGenerator) -> None:
    voice = Voice(13, 64, seed=8)
    runs = {}
    for mode in ("exact", "cached", "incremental"):
        token2wav = Token2Wav(flow, hift, EngineStats(), mode)
        runs[mode] = _run(token2wav, _request(voice, stream=True, first_hop=5))
    exact, _ = runs["exact"]
    assert len(exact) >= 4
    assert runs["exact"][1] == [False] * len(exact)
    for mode in ("cached", "incremental"):
        audio, cached = runs[mode]
        assert cached == [True] * (len(exact) - 1) + [False]  # dropped with the final chunk
        assert [a.shape for a in audio] == [a.shape for a in exact]
        for got, want in zip(audio[:-1], exact[:-1], strict=True):
            assert float(np.abs(got - want).max()) <= _TOL
    assert float(np.abs(runs["cached"][0][-1] - exact[-1]).max()) <= _TOL
    assert float(np.abs(runs["incremental"][0][-1] - exact[-1]).max()) > _TOL


@pytest.mark.parametrize("mode", ["cached", "incremental"])
def test_token2wav_leaves_one_chunk_streams_and_offline_requests_as_upstream(
    flow: Flow, hift: HiFTGenerator, mode: FlowCacheMode
) -> None:
    voice = Voice(13, 20, seed=10)  # fewer tokens than the first hop: one (final) chunk
    for stream in (True, False):
        want, _ = _run(Token2Wav(flow, hift, EngineStats(), "exact"), _request(voice, stream))
        got, cached = _run(Token2Wav(flow, hift, EngineStats(), mode), _request(voice, stream))
        assert len(got) == len(want) == 1 and cached == [False]
        assert float(np.abs(got[0] - want[0]).max()) <= _TOL


def test_engine_frees_the_flow_cache_of_an_aborted_stream(flow: Flow, hift: HiFTGenerator) -> None:
    lm = CosyVoice2LM(TINY.lm)
    randomize_(lm, torch.Generator().manual_seed(2))
    engine = Engine(lm.eval(), flow, hift, EngineConfig(max_active=1, max_len=64, flow_cache="incremental"))
    engine.token2wav.flow_cache = "incremental"  # as the config says, however the engine passes it
    voice = Voice(25, 120, seed=11)
    engine.add(_request(voice, stream=True).spec)
    while not any(out.audio is not None and out.audio.size for out in engine.step()):
        pass
    # Reaching into the engine only to observe: the first chunk left a cache on the segment.
    cache = engine._requests["r"].segments[0].flow_cache
    assert cache is not None and cache.nbytes() > 0
    ref = weakref.ref(cache)
    del cache
    assert engine.abort("r")
    gc.collect()
    assert ref() is None


def test_engine_config_checks_the_flow_cache_mode_and_dtype() -> None:
    assert EngineConfig().flow_cache in ("exact", "cached", "incremental")
    with pytest.raises(ValueError, match="flow_cache"):
        EngineConfig(flow_cache="fast")  # type: ignore[arg-type]
    assert EngineConfig().flow_cache_dtype == "computed"
    with pytest.raises(ValueError, match="flow_cache_dtype"):
        EngineConfig(flow_cache_dtype="int4")  # type: ignore[arg-type]


@pytest.mark.parametrize(("prompt", "tokens", "first_hop"), [(25, 130, 5), (13, 70, None), (0, 58, 7)])
@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize("dtype", [None, torch.float16, torch.int8])
def test_stream_cache_bytes_bounds_the_cache_a_stream_holds(
    flow: Flow, prompt: int, tokens: int, first_hop: int | None, compact: bool, dtype: torch.dtype | None
) -> None:
    voice = Voice(prompt, tokens, seed=prompt + 1)
    cache = flow.new_stream_cache(compact, dtype)
    exact = flow.stream_cache_bytes(prompt + tokens, compact, dtype)
    for chunk in voice.chunks(first_hop):
        voice.incremental(flow, cache, chunk)
        if not chunk.finalize:
            # Grown x1.5 at a time: at most half again the whole stream's states, at least
            # the cached positions'.
            low = flow.stream_cache_bytes(cache.tokens, compact, dtype)
            assert low <= cache.nbytes() <= 3 * exact // 2, chunk


def test_a_compact_cache_keeps_the_estimator_layers_inputs_instead_of_keys_and_values(flow: Flow) -> None:
    voice = Voice(25, 64, seed=4)
    full, compact = flow.new_stream_cache(), flow.new_stream_cache(compact=True)
    first = next(voice.chunks(5))
    voice.incremental(flow, full, first)
    voice.incremental(flow, compact, first)
    assert compact.tokens == full.tokens > 0
    # The encoder's states are the same; every Euler step's are the inputs (width C, one
    # tensor a layer) instead of keys and values (2 x heads x head_dim, two tensors).
    assert compact.encoder_frames.nbytes() == full.encoder_frames.nbytes()
    estimator = flow.cfm.estimator
    inner = sum(2 * m.heads * m.head_dim for m in estimator.modules() if isinstance(m, SelfAttention))
    width = sum(m.dim for m in estimator.modules() if isinstance(m, SelfAttention))
    assert width < inner
    frames = flow.token_mel_ratio * (25 + first.token_end - flow.pre_lookahead_len)  # uncommitted too
    size = flow.speaker_proj.weight.element_size()
    # Each step's first pass holds every frame it computed, for both CFG rows.
    assert sum(s.nbytes() for s in full.steps) - sum(s.nbytes() for s in compact.steps) == (
        len(full.steps) * 2 * frames * size * (inner - width)
    )


@pytest.mark.parametrize(("prompt", "tokens", "first_hop"), [(25, 130, 5), (0, 58, 7)])
@pytest.mark.parametrize("compact", [False, True])
def test_a_reserved_stream_cache_is_allocated_once_after_the_first_chunk(
    flow: Flow, prompt: int, tokens: int, first_hop: int | None, compact: bool
) -> None:
    voice = Voice(prompt, tokens, seed=prompt + 1)
    cache, alone = flow.new_stream_cache(compact), flow.new_stream_cache()
    cache.reserve(prompt + tokens, flow.token_mel_ratio)
    buffers: list[int] = []
    first, *chunks = voice.chunks(first_hop)
    voice.incremental(flow, cache, first)  # at its own size: the first chunk's latency counts
    written = prompt + first.token_end - flow.pre_lookahead_len
    assert cache.nbytes() - _contexts(cache) == flow.stream_cache_bytes(written, compact)
    reserved = flow.stream_cache_bytes(prompt + tokens, compact)
    for chunk in chunks:
        mel = voice.incremental(flow, cache, chunk)
        # The same up to float rounding (the buffers' strides differ, and so do the GEMMs).
        torch.testing.assert_close(mel, voice.incremental(flow, alone, chunk))
        if not chunk.finalize:
            assert cache.nbytes() - _contexts(cache) == reserved, chunk
            pointers = [t.data_ptr() for t in cache.tensors() if t.dim() == 4]
            assert pointers == (buffers or pointers), "a reserved buffer was reallocated"
            buffers = pointers


def _contexts(cache: FlowStreamCache, states: list[LayerStates] | None = None) -> int:
    """Bytes of the causal convolutions' cached contexts (3-D; keys and values are 4-D) in
    ``states`` (default: all of ``cache``'s)."""
    tensors = cache.tensors() if states is None else [t for s in states for t in s.tensors()]
    return sum(t.numel() * t.element_size() for t in tensors if t.dim() == 3)
