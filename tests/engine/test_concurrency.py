"""Many requests in one engine give each the tokens and audio it gets alone; aborts and
failures touch only their own request; overload is refused at once."""

import asyncio
import dataclasses
import gc
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from cosyserve.bench.engine_runs import (
    RequestResult,
    collect,
    make_engine,
    mixed_specs,
    run_alone,
    run_together,
)
from cosyserve.engine.admission import OverloadedError
from cosyserve.engine.async_engine import AsyncEngine, EngineDeadError
from cosyserve.engine.engine import Engine
from cosyserve.engine.loader import LoadedModel, load_model
from cosyserve.engine.request import GenerationSpec, Request
from tests.engine.helpers import assert_same


@pytest.fixture(scope="module")
def specs(tiny_model: LoadedModel) -> list[GenerationSpec]:
    return mixed_specs(tiny_model)


@pytest.fixture(scope="module")
def alone(tiny_model: LoadedModel, specs: list[GenerationSpec]) -> dict[str, RequestResult]:
    return run_alone(tiny_model, specs)


@pytest.fixture
def async_engine(tiny_model: LoadedModel) -> Iterator[AsyncEngine]:
    engine = AsyncEngine(make_engine(tiny_model, max_active=16))
    engine.start()
    yield engine
    engine.shutdown()
    assert not any(t.name == "cosyserve-engine" and t.is_alive() for t in threading.enumerate())


def renamed(specs: list[GenerationSpec], suffix: str) -> list[GenerationSpec]:
    return [dataclasses.replace(s, request_id=s.request_id + suffix) for s in specs]


def assert_idle(engine: Engine) -> None:
    cache = engine.lm_runner.cache
    assert not engine.has_work() and engine.active_requests == 0
    assert len(engine.scheduler) == 0
    assert cache.free_slots == engine.config.max_active  # every request slot (not the scratch slot)
    prefix = engine.prefix_cache
    assert prefix is None or len(prefix) <= prefix.max_blocks


def running(engine: Engine) -> dict[str, Request]:
    return {r.id: r for r in engine.scheduler.running}


async def consume(engine: AsyncEngine, spec: GenerationSpec, stop_after: int | None = None) -> RequestResult:
    result = RequestResult()
    chunks = engine.generate(spec)
    try:
        async for chunk in chunks:
            if chunk.audio.size:
                result.chunks.append(chunk.audio)
            if chunk.speech_tokens is not None:
                result.tokens, result.finished = chunk.speech_tokens, True
            if stop_after is not None and len(result.chunks) >= stop_after:
                break
    finally:
        await chunks.aclose()
    return result


async def wait_idle(engine: AsyncEngine, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.active_requests or engine.engine.has_work():
        assert time.monotonic() < deadline, "the engine did not become idle"
        await asyncio.sleep(0.01)


# -- one engine, driven here ---------------------------------------------------------------


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
def test_sixteen_concurrent_requests_match_their_solo_runs(
    tiny_model: LoadedModel, specs: list[GenerationSpec], alone: dict[str, RequestResult], traced: bool
) -> None:
    # Traced: decode steps replayed from TorchScript traces (traced_decode, the default),
    # one for a lone row and one for larger batches, over each step's span; the solo runs
    # are eager.
    engine = make_engine(tiny_model, max_active=16, traced_decode=traced)
    assert (engine.lm_runner.decode_graphs is not None) == traced
    results = run_together(engine, specs)
    assert_same(results, alone, [s.request_id for s in specs])
    # They ran as one batch (16 requests of 12..42 tokens: mostly 16 per step).
    assert engine.stats.decoded_tokens > 8 * engine.stats.decode_steps
    # Some of their token2wav chunks were ready in the same step and ran as one batch
    # (their lengths differ, so most were not; tests/engine/test_token2wav_batch.py has more).
    stats = engine.stats
    assert stats.flow_rows + stats.hift_rows > stats.flow_calls + stats.hift_calls, stats
    assert_idle(engine)
    # Again in the same engine: now every input's start comes from the prefix cache.
    second = renamed(specs, "-again")
    results = run_together(engine, second)
    for spec, again in zip(specs, second, strict=True):
        results[spec.request_id] = results.pop(again.request_id)
    assert_same(results, alone, [s.request_id for s in specs])
    assert engine.prefix_cache is not None and engine.prefix_cache.stats.hits >= len(specs)
    assert_idle(engine)


@pytest.mark.filterwarnings("ignore:.*deprecated.*")
def test_int8_requests_match_their_solo_runs(tiny_model_dir: Path) -> None:
    # Dynamic int8 quantizes activations per call: per row, so that a request's tokens do
    # not depend on the requests sharing its decode steps (with one scale per call, all 16
    # differed from their solo runs), nor on how the step budget splits its prompt among
    # the prefills (40 positions: concurrent prompts are split otherwise than alone).
    model = load_model(tiny_model_dir, quantize="int8")
    specs = mixed_specs(model)
    results = run_together(make_engine(model, max_active=16, prefill_chunk=40), specs)
    assert_same(results, run_alone(model, specs), [s.request_id for s in specs])


def test_aborting_half_mid_stream_frees_everything(
    tiny_model: LoadedModel, specs: list[GenerationSpec], alone: dict[str, RequestResult]
) -> None:
    engine = make_engine(tiny_model, max_active=16)
    for spec in specs:
        engine.add(spec)
    results: dict[str, RequestResult] = {}
    collect(engine.step(), results)
    refs = [weakref.ref(r) for r in engine.scheduler.running]
    assert len(refs) == len(specs)
    # Streams are aborted after their first chunk, the others while they decode.
    to_abort = {s.request_id for s in specs[::4]} | {s.request_id for s in specs[1::4]}
    aborted: set[str] = set()
    while engine.has_work():
        collect(engine.step(), results)
        live = running(engine)
        for request_id in to_abort - aborted:
            request = live.get(request_id)
            if request is None:
                continue
            started = results.get(request_id) if request.spec.stream else None
            if (started is not None and started.chunks) or (
                not request.spec.stream and request.lm_state.tokens
            ):
                assert engine.abort(request_id)
                aborted.add(request_id)
    assert aborted == to_abort, "every request to abort was aborted mid-way"
    assert all(not results[i].finished for i in aborted if i in results)
    assert_same(results, alone, [s.request_id for s in specs if s.request_id not in aborted])
    assert_idle(engine)
    del live, request
    gc.collect()
    assert all(ref() is None for ref in refs), "a request's state outlived it"


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
def test_a_failing_request_fails_alone(
    tiny_model: LoadedModel,
    specs: list[GenerationSpec],
    alone: dict[str, RequestResult],
    monkeypatch: pytest.MonkeyPatch,
    traced: bool,
) -> None:
    good = specs[:6]
    bad_input = dataclasses.replace(specs[6], request_id="bad-input", segments=(dataclasses.replace(
        specs[6].segments[0], text_ids=(10**9,)),))  # fmt: skip
    nan = dataclasses.replace(specs[7], request_id="nan")
    crash = dataclasses.replace(specs[8], request_id="crash")
    engine = make_engine(tiny_model, max_active=16, traced_decode=traced)
    # The failures go into whichever decode the engine steps with: the LM's, or the replays'.
    graphs = engine.lm_runner.decode_graphs
    real_decode: Callable[..., torch.Tensor] = tiny_model.lm.decode if graphs is None else graphs.decode

    def decode(tokens: torch.Tensor, slots: list[int], *cache: Any) -> torch.Tensor:
        live = running(engine)
        if "crash" in live and live["crash"].slot in slots and len(live["crash"].lm_state.tokens) >= 4:
            raise RuntimeError("a kernel failed")  # whoever's batch this is: retried alone
        out = real_decode(tokens, slots, *cache)
        if "nan" in live and live["nan"].slot in slots and len(live["nan"].lm_state.tokens) >= 3:
            out[slots.index(live["nan"].slot)] = float("nan")
        return out

    monkeypatch.setattr(tiny_model.lm if graphs is None else graphs, "decode", decode)
    results = run_together(engine, [*good, bad_input, nan, crash])
    assert results["bad-input"].error is not None and results["bad-input"].error.code == "invalid_request"
    assert results["nan"].error is not None and results["nan"].error.code == "numerical_error"
    assert results["crash"].error is not None and results["crash"].error.code == "internal_error"
    assert str(10**9) not in str(results["bad-input"].error)  # it names the limit, not the input
    assert_same(results, alone, [s.request_id for s in good])
    assert_idle(engine)


# -- the asyncio front, with its real thread -----------------------------------------------


def test_async_engine_requests_match_their_solo_runs(
    async_engine: AsyncEngine, specs: list[GenerationSpec], alone: dict[str, RequestResult]
) -> None:
    async def main() -> list[RequestResult]:
        return await asyncio.gather(*(consume(async_engine, s) for s in specs))

    results = dict(zip([s.request_id for s in specs], asyncio.run(main()), strict=True))
    assert_same(results, alone, [s.request_id for s in specs])
    assert async_engine.active_requests == 0
    assert_idle(async_engine.engine)


def test_async_engine_abort_half_and_shutdown(
    async_engine: AsyncEngine, specs: list[GenerationSpec], alone: dict[str, RequestResult]
) -> None:
    stopped = {s.request_id for s in specs if s.first_hop is not None}  # several chunks each

    async def main() -> list[RequestResult]:
        runs = [consume(async_engine, s, 1 if s.request_id in stopped else None) for s in specs]
        results = await asyncio.gather(*runs)
        await wait_idle(async_engine)
        return results

    results = dict(zip([s.request_id for s in specs], asyncio.run(main()), strict=True))
    assert all(not results[i].finished for i in stopped)
    assert_same(results, alone, [s.request_id for s in specs if s.request_id not in stopped])
    assert_idle(async_engine.engine)
    async_engine.shutdown()
    assert not async_engine.alive


def test_async_engine_overload_and_shutdown_with_requests_in_flight(
    tiny_model: LoadedModel, specs: list[GenerationSpec]
) -> None:
    engine = AsyncEngine(make_engine(tiny_model, max_active=1, max_waiting=1))
    engine.start()
    long = [dataclasses.replace(s, request_id=f"long-{i}", min_tokens=400, max_tokens=400) for i, s in
            enumerate(specs[:3])]  # fmt: skip

    async def main() -> None:
        first, second = engine.generate(long[0]), engine.generate(long[1])
        tasks = [asyncio.ensure_future(anext(first)), asyncio.ensure_future(anext(second))]
        await asyncio.sleep(0)  # both are registered now, and far from done
        start = time.monotonic()
        with pytest.raises(OverloadedError):
            await anext(engine.generate(long[2]))
        assert time.monotonic() - start < 0.5
        engine.shutdown()
        for task in tasks:
            with pytest.raises(EngineDeadError):
                await task
        with pytest.raises(EngineDeadError):
            await anext(engine.generate(specs[3]))
        await first.aclose()
        await second.aclose()

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
    assert not engine.alive and not any(t.name == "cosyserve-engine" for t in threading.enumerate())
    assert_idle(engine.engine)
