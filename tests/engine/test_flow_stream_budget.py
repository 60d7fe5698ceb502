"""The budget of the streams' flow caches: a stream that fits keeps an incremental cache;
one that does not recomputes every chunk (the exact mode's audio); a reservation ends
with its stream, finished or aborted."""

import math

import numpy as np
import pytest
import torch

from cosyserve.accel.flow_cache_mode import FlowCacheDtype
from cosyserve.bench.engine_runs import RequestResult, collect, drain, run_together
from cosyserve.bench.workload import synthetic_spec, synthetic_text_ids, synthetic_voice
from cosyserve.engine.config import EngineConfig, FlowCacheMode
from cosyserve.engine.engine import Engine
from cosyserve.engine.loader import LoadedModel
from cosyserve.engine.request import GenerationSpec
from tests.engine.helpers import assert_same

TOKENS = 60


def _specs(model: LoadedModel, count: int) -> list[GenerationSpec]:
    voice = synthetic_voice(model.hparams, 1.0, seed=90)
    return [
        synthetic_spec(
            f"budget-{i}",
            voice,
            synthetic_text_ids(model.hparams, TOKENS, seed=i),
            tokens=TOKENS,
            seed=900 + i,
            stream=True,
            first_hop=5,
        )
        for i in range(count)
    ]


def _need(model: LoadedModel, spec: GenerationSpec) -> int:
    tokens = int(spec.flow_prompt_tokens.numel()) + TOKENS
    return model.flow.stream_cache_bytes(tokens, EngineConfig().flow_cache_compact)


def _engine(
    model: LoadedModel, mode: FlowCacheMode, budget_mb: int, cache_dtype: FlowCacheDtype = "computed"
) -> Engine:
    config = EngineConfig(
        max_active=4,
        flow_cache=mode,
        flow_stream_cache_mb=budget_mb,
        flow_prompt_cache_mb=0,
        flow_cache_dtype=cache_dtype,
    )
    return Engine(model.lm, model.flow, model.hift, config)


def _room_for_one(model: LoadedModel, spec: GenerationSpec) -> int:
    """A budget in MiB that holds one stream's reservation and not two."""
    budget = math.ceil(1.5 * _need(model, spec) / 2**20)
    assert _need(model, spec) <= budget << 20 < 2 * _need(model, spec)
    return budget


@pytest.mark.parametrize(
    ("held", "dtype", "tol"), [("fp16", torch.float16, 2e-3), ("int8", torch.int8, 2e-2)]
)
def test_narrower_caches_fit_a_stream_whose_float32_cache_does_not(
    tiny_model: LoadedModel, held: FlowCacheDtype, dtype: torch.dtype, tol: float
) -> None:
    (spec,) = _specs(tiny_model, 1)
    tokens = int(spec.flow_prompt_tokens.numel()) + TOKENS
    compact = EngineConfig().flow_cache_compact
    narrow = tiny_model.flow.stream_cache_bytes(tokens, compact, dtype)
    budget = math.ceil(narrow / 2**20)
    assert narrow <= budget << 20 < _need(tiny_model, spec)
    for cache_dtype, refusals in (("computed", 1), (held, 0)):
        engine = _engine(tiny_model, "incremental", budget, cache_dtype)
        got = run_together(engine, [spec])[spec.request_id]
        assert engine.stats.flow_cache_refusals == refusals
    want = run_together(_engine(tiny_model, "incremental", 0), [spec])[spec.request_id]
    assert [c.size for c in got.chunks] == [c.size for c in want.chunks]
    assert 0 < float(np.abs(got.audio - want.audio).max()) <= tol  # docs/precision.md


def test_a_stream_beyond_the_budget_recomputes_its_chunks(tiny_model: LoadedModel) -> None:
    first, second = _specs(tiny_model, 2)
    engine = _engine(tiny_model, "incremental", _room_for_one(tiny_model, first))
    got = run_together(engine, [first, second])
    # The first stream reserved its cache; the second had no room and ran as "exact".
    assert engine.stats.flow_cache_refusals == 1
    want = {
        first.request_id: run_together(_engine(tiny_model, "incremental", 0), [first])[first.request_id],
        second.request_id: run_together(_engine(tiny_model, "exact", 0), [second])[second.request_id],
    }
    assert_same(got, want, [first.request_id, second.request_id])


def test_a_finished_stream_gives_its_reservation_back(tiny_model: LoadedModel) -> None:
    first, second = _specs(tiny_model, 2)
    engine = _engine(tiny_model, "incremental", _room_for_one(tiny_model, first))
    run_together(engine, [first])
    run_together(engine, [second])  # after the first: its reservation is free again
    assert engine.stats.flow_cache_refusals == 0


def test_an_aborted_stream_gives_its_reservation_back(tiny_model: LoadedModel) -> None:
    first, second = _specs(tiny_model, 2)
    engine = _engine(tiny_model, "incremental", _room_for_one(tiny_model, first))
    results: dict[str, RequestResult] = {}
    engine.add(first)
    while not results.get(first.request_id, RequestResult()).chunks:  # its cache exists after the first chunk
        collect(engine.step(), results)
    assert engine.abort(first.request_id)
    engine.add(second)
    drain(engine, results)
    assert engine.stats.flow_cache_refusals == 0
    assert results[second.request_id].finished and results[second.request_id].error is None


def test_a_stream_cache_takes_its_reservation_after_its_first_chunk(tiny_model: LoadedModel) -> None:
    # On CPU the cache's buffers are allocated for the segment's longest output after its
    # first chunk (then never regrown) and hold what the budget reserved for them.
    (spec,) = _specs(tiny_model, 1)
    engine = _engine(tiny_model, "incremental", 1024)
    engine.add(spec)
    results: dict[str, RequestResult] = {}
    sizes = []
    while not results.get(spec.request_id, RequestResult()).finished:
        collect(engine.step(), results)
        for request in engine.scheduler.running:
            (seg,) = request.segments
            if seg.flow_cache is not None:
                keys_values = [t for t in seg.flow_cache.tensors() if t.dim() == 4]
                sizes.append(sum(t.numel() * t.element_size() for t in keys_values))
                assert seg.flow_reserved == _need(tiny_model, spec)
    first, *later = dict.fromkeys(sizes)  # the sizes it had, in order
    assert first < _need(tiny_model, spec) and later == [_need(tiny_model, spec)]


def test_a_stream_larger_than_the_whole_budget_runs_as_exact(tiny_model: LoadedModel) -> None:
    (spec,) = _specs(tiny_model, 1)
    assert _need(tiny_model, spec) > 2**20
    engine = _engine(tiny_model, "incremental", 1)
    got = run_together(engine, [spec])
    want = run_together(_engine(tiny_model, "exact", 0), [spec])
    assert_same(got, want, [spec.request_id])
    assert engine.stats.flow_cache_refusals == 1


def test_the_budget_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="flow_stream_cache_mb"):
        EngineConfig(flow_stream_cache_mb=-1)
