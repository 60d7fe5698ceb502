"""Ready token2wav chunks of several requests run as batches (flow with CFG pairs, HiFT),
and every request still gets the audio it gets alone; a failure in a batch fails only
the request that fails alone."""

import dataclasses

import pytest

from cosyserve.bench.engine_runs import RequestResult, drain, make_engine, run_alone, run_together, voices
from cosyserve.bench.workload import synthetic_spec, synthetic_text_ids
from cosyserve.engine.config import FlowCacheMode
from cosyserve.engine.engine import Engine
from cosyserve.engine.loader import LoadedModel
from cosyserve.engine.request import GenerationSpec
from cosyserve.engine.token2wav import ChunkWork
from cosyserve.models.flow.stream_cache import FlowStreamCache
from tests.engine.helpers import assert_same


def lockstep_specs(model: LoadedModel, stream: bool, count: int = 6) -> list[GenerationSpec]:
    """Requests that decode in step: the same token count, three voices (prompts of
    different lengths), their own seeds; half with a short first hop when streaming."""
    vs = voices(model)
    return [
        synthetic_spec(
            f"lock-{i}",
            vs[i % len(vs)],
            synthetic_text_ids(model.hparams, 6, seed=i),
            tokens=40,
            seed=500 + i,
            stream=stream,
            first_hop=8 if stream and i % 2 else None,
        )
        for i in range(count)
    ]


def alone(model: LoadedModel, specs: list[GenerationSpec], mode: FlowCacheMode) -> dict[str, RequestResult]:
    return run_alone(model, specs, flow_cache=mode, traced_decode=True)


@pytest.mark.parametrize(
    ("stream", "mode"), [(False, "incremental"), (True, "exact"), (True, "cached"), (True, "incremental")]
)
def test_batched_chunks_give_each_request_its_solo_audio(
    tiny_model: LoadedModel, stream: bool, mode: FlowCacheMode
) -> None:
    specs = lockstep_specs(tiny_model, stream)
    engine = make_engine(tiny_model, max_active=len(specs), flow_cache=mode)  # type: ignore[arg-type]
    results = run_together(engine, specs)
    assert_same(results, alone(tiny_model, specs, mode), [s.request_id for s in specs])
    stats = engine.stats
    # Incremental streams batch only with streams holding as many cached tokens (the same
    # voice prefix and first hop); ragged full passes batch whatever is ready.
    if mode == "exact" or not stream:
        assert stats.flow_rows >= 2 * stats.flow_calls, stats
    assert stats.flow_rows > stats.flow_calls, stats
    # HiFT batches chunks of equal mel length only: the prompts' lengths split first chunks.
    assert stats.hift_rows > stats.hift_calls, stats


def test_a_chunk_that_fails_in_a_batch_fails_alone(
    tiny_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    specs = lockstep_specs(tiny_model, stream=True)
    engine: Engine = make_engine(tiny_model, max_active=len(specs))
    token2wav = engine.token2wav
    real_row = token2wav._row
    batches: list[int] = []
    real_run = token2wav.run

    def run(work: list[ChunkWork]) -> list[object]:
        batches.append(len(work))
        return real_run(work)  # type: ignore[return-value]

    def row(item: ChunkWork) -> object:
        if item.request.id == "lock-3" and item.chunk.offset > 0:
            raise RuntimeError("a kernel failed")  # in whichever batch lock-3's second chunk is
        return real_row(item)

    monkeypatch.setattr(token2wav, "_row", row)
    monkeypatch.setattr(token2wav, "run", run)
    results = run_together(engine, specs)
    assert results["lock-3"].error is not None and results["lock-3"].error.code == "internal_error"
    assert results["lock-3"].chunks  # its first chunk came out before
    ok = [s for s in specs if s.request_id != "lock-3"]
    assert_same(results, alone(tiny_model, ok, "incremental"), [s.request_id for s in ok])
    assert max(batches) > 1


def test_the_batch_is_bounded_and_first_chunks_go_first(tiny_model: LoadedModel) -> None:
    specs = lockstep_specs(tiny_model, stream=True)
    engine = make_engine(tiny_model, max_active=8, token2wav_batch=3)
    results = run_together(engine, specs)
    assert all(r.error is None and r.finished for r in results.values())
    assert engine.stats.flow_rows <= 3 * engine.stats.flow_calls
    assert engine.stats.flow_rows > engine.stats.flow_calls
    # Now some requests are mid-stream and others new: the new ones' chunks are picked first.
    for spec in specs:
        engine.add(dataclasses.replace(spec, request_id=spec.request_id + "-again"))
    while not (work := engine.scheduler.vocode_work()):
        engine.step()
    assert [r.emitted_audio for r, _, _ in work] == sorted(r.emitted_audio for r, _, _ in work)
    drain(engine, results)


def test_incremental_chunks_run_at_most_flow_stream_rows_to_a_flow_call(
    tiny_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    specs = lockstep_specs(tiny_model, stream=True)
    sizes: dict[int, list[int]] = {}
    results: dict[int, dict[str, RequestResult]] = {}
    for rows in (0, 1, 2):
        engine = make_engine(tiny_model, max_active=len(specs), flow_stream_rows=rows)
        token2wav = engine.token2wav
        real = token2wav._flow_incremental
        calls = sizes.setdefault(rows, [])

        def counted(work: list[ChunkWork], real: object = real, calls: list[int] = calls) -> object:
            calls.append(len(work))
            return real(work)  # type: ignore[operator]

        monkeypatch.setattr(token2wav, "_flow_incremental", counted)
        results[rows] = run_together(engine, specs)
    assert max(sizes[0]) >= 3 and max(sizes[1]) == 1 and max(sizes[2]) == 2
    assert sum(sizes[0]) == sum(sizes[1]) == sum(sizes[2])  # every chunk ran, once
    ids = [s.request_id for s in specs]
    assert_same(results[1], results[0], ids)
    assert_same(results[2], results[0], ids)


def test_compact_flow_caches_give_every_stream_the_same_audio(
    tiny_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    specs = lockstep_specs(tiny_model, stream=True)
    results = {}
    for compact in (False, True):
        engine = make_engine(tiny_model, max_active=len(specs), flow_cache_compact=compact)
        token2wav = engine.token2wav
        real = token2wav._new_flow_cache
        caches: list[FlowStreamCache] = []

        def recorded(item: ChunkWork, real: object = real, caches: list[FlowStreamCache] = caches) -> object:
            caches.append(real(item))  # type: ignore[operator]
            return caches[-1]

        monkeypatch.setattr(token2wav, "_new_flow_cache", recorded)
        results[compact] = run_together(engine, specs)
        assert len(caches) >= len(specs) // 2 and all(c.compact == compact for c in caches)
    assert_same(results[True], results[False], [s.request_id for s in specs])
