"""The estimator's calls replayed from traces (``Flow.trace_steps_``) give the eager
calls' bits: incremental streaming (lone and batched streams, ragged batches with an
attention bias, forks of a primed voice's shared cached positions) and whole
non-streaming calls, with float32 and packed bfloat16 weights; traces from the cache
(``TraceCache``) give the fresh traces' bits."""

import copy
from pathlib import Path

import pytest
import torch

from cosyserve.accel.quantize import fp16_weights_
from cosyserve.modeldir.presets import TINY
from cosyserve.models.flow import Flow
from cosyserve.models.flow.blocks import pack_convs_
from cosyserve.models.flow.rows import FlowRow, infer_rows
from cosyserve.models.flow.stream_cache import FlowStreamCache
from cosyserve.models.packed_linear import PackedLinear, pack_linears_, packing_available
from cosyserve.models.trace_cache import TraceCache
from tests.models.flow.test_flow_rows import Voice, stream_in_lockstep
from tests.models.test_trace_cache import count_traces


def _in_dtype(flow: Flow, dtype: torch.dtype) -> Flow:
    copied = copy.deepcopy(flow).to(dtype)
    if dtype == torch.bfloat16:
        pack_linears_(copied.cfm.estimator)
        pack_convs_(copied.cfm.estimator)
    return copied


def _eager_and_traced(flow: Flow, dtype: torch.dtype) -> tuple[Flow, Flow]:
    """Two copies of ``flow`` in ``dtype``, the second with its estimator calls traced."""
    if dtype == torch.bfloat16 and not packing_available():
        pytest.skip("this CPU has no oneDNN bfloat16 matmul")
    eager, traced = _in_dtype(flow, dtype), _in_dtype(flow, dtype)
    assert traced.trace_steps_()
    return eager, traced


def _lockstep(
    flow: Flow,
    voices: list[Voice],
    hops: list[int | None],
    primed: FlowStreamCache,
    compact: bool = False,
    cache_dtype: torch.dtype | None = None,
) -> list[list[torch.Tensor]]:
    """Each voice streamed, those of the primed voice forked from it, in lockstep batches."""
    streams = [v.chunks(h) for v, h in zip(voices, hops, strict=True)]
    shared = voices[0].prompt_token
    caches = [
        primed.fork(compact, cache_dtype)
        if v.prompt_token is shared
        else flow.new_stream_cache(compact, cache_dtype)
        for v in voices
    ]
    got, batches = stream_in_lockstep(flow, voices, streams, caches)
    assert max(batches) >= 2
    return got


@pytest.mark.parametrize(
    ("dtype", "cache_dtype"), [(torch.float32, None), (torch.bfloat16, None), (torch.float32, torch.float16)]
)
@pytest.mark.parametrize("compact", [False, True])
def test_traced_streams_give_the_eager_streams_bits(
    flow: Flow, dtype: torch.dtype, cache_dtype: torch.dtype | None, compact: bool
) -> None:
    eager, traced = _eager_and_traced(flow, dtype)
    assert traced.cfm.traced_steps is not None
    if dtype == torch.bfloat16:
        assert any(isinstance(m, PackedLinear) for m in traced.modules())
    # Streaming: with and without a bias, and float32's convolutions as products or not;
    # one more for whole calls.
    assert traced.cfm.traced_steps.traces == (3 if dtype == torch.bfloat16 else 5)
    # Replays never run the estimator's Python.
    traced.cfm.estimator.forward = _not_called  # type: ignore[method-assign]
    voices = [Voice(53, 80, 5), Voice(13, 71, 6), Voice(20, 64, 7), Voice(53, 58, 8)]
    voices[3].prompt_token, voices[3].prompt_feat, voices[3].embedding = (
        voices[0].prompt_token,
        voices[0].prompt_feat,
        voices[0].embedding,
    )
    hops = [5, None, None, 6]  # short first hops put streams out of step: ragged batches
    want = _lockstep(eager, voices, hops, eager.prime_stream(*_voice(voices[0])), compact, cache_dtype)
    got = _lockstep(traced, voices, hops, traced.prime_stream(*_voice(voices[0])), compact, cache_dtype)
    for g, w in zip(got, want, strict=True):
        assert len(g) == len(w)
        assert all(torch.equal(a, b) for a, b in zip(g, w, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_traced_whole_calls_give_the_eager_calls_bits(flow: Flow, dtype: torch.dtype) -> None:
    eager, traced = _eager_and_traced(flow, dtype)
    estimator_calls = _count_calls(traced)
    alone, other = Voice(40, 70, 9), Voice(20, 110, 10)  # 220 frames each; 260 frames
    same_length = [_row(alone), _row(alone, seed=11)]
    for rows, replayed in [([_row(alone)], True), (same_length, True), ([_row(alone), _row(other)], False)]:
        estimator_calls.clear()
        got = infer_rows(traced, rows, streaming=False, finalize=True)
        want = infer_rows(eager, rows, streaming=False, finalize=True)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
        # Rows of one length need no attention bias: replayed. Ragged rows run eagerly.
        assert len(estimator_calls) == (0 if replayed else traced.cfg.cfm.n_timesteps)


def _row(voice: Voice, seed: int | None = None) -> FlowRow:
    tokens = voice.tokens
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, TINY.flow.vocab_size, tokens.shape, generator=gen)
    return FlowRow(tokens, voice.prompt_token, voice.prompt_feat, voice.embedding)


def _count_calls(flow: Flow) -> list[None]:
    """A list that grows by one per eager call of ``flow``'s estimator."""
    calls: list[None] = []
    estimator = flow.cfm.estimator
    forward = estimator.forward

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(None)
        return forward(*args, **kwargs)  # type: ignore[arg-type]

    estimator.forward = counted  # type: ignore[method-assign]
    return calls


def _voice(voice: Voice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return voice.prompt_token[None], voice.prompt_feat[None], voice.embedding[None]


def _not_called(*args: object, **kwargs: object) -> torch.Tensor:
    raise AssertionError("the estimator ran eagerly")


@pytest.mark.parametrize("weights", ["fp32", "fp16"])
def test_traces_from_the_cache_give_the_fresh_traces_bits(
    flow: Flow, weights: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = count_traces(monkeypatch)
    fresh, cached = copy.deepcopy(flow), copy.deepcopy(flow)
    if weights == "fp16":  # packed weights: objects, not tensors
        fp16_weights_(fresh.cfm.estimator)
        fp16_weights_(cached.cfm.estimator)
    cache = TraceCache(tmp_path, "model")
    assert fresh.trace_steps_(cache) and fresh.cfm.traced_steps is not None
    traces = fresh.cfm.traced_steps.traces
    assert len(made) == traces == len(list(tmp_path.iterdir()))
    assert cached.trace_steps_(cache) and cached.cfm.traced_steps is not None
    assert len(made) == traces == cached.cfm.traced_steps.traces  # none made: all from the files
    voices = [Voice(53, 80, 5), Voice(13, 71, 6), Voice(20, 64, 7)]
    hops = [5, None, 6]  # out of step: ragged batches, with an attention bias
    want = _lockstep(fresh, voices, hops, fresh.prime_stream(*_voice(voices[0])))
    got = _lockstep(cached, voices, hops, cached.prime_stream(*_voice(voices[0])))
    for g, w in zip(got, want, strict=True):
        assert len(g) == len(w) and all(torch.equal(a, b) for a, b in zip(g, w, strict=True))
