"""Device failures: out of memory fails one request (503), a broken device kills the engine."""

import asyncio
import logging
import time

import pytest
import torch

from cosyserve.bench.engine_runs import RequestResult, drain, make_engine, voices
from cosyserve.bench.workload import synthetic_spec
from cosyserve.engine.async_engine import AsyncEngine, EngineDeadError
from cosyserve.engine.engine import DeviceOutOfMemoryError, Engine
from cosyserve.engine.loader import LoadedModel, load_model
from cosyserve.server.error_map import map_error


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir: object) -> LoadedModel:
    return load_model(tiny_model_dir)  # type: ignore[arg-type]


def _specs(model: LoadedModel) -> list:  # type: ignore[type-arg]
    voice = voices(model, 1)[0]
    return [synthetic_spec(f"r{i}", voice, (5, 6, 7), tokens=8, seed=i) for i in range(2)]


def test_out_of_memory_fails_only_that_request_and_frees_it(
    tiny_model: LoadedModel, caplog: pytest.LogCaptureFixture
) -> None:
    engine = make_engine(tiny_model, max_active=2)
    run = engine.token2wav.run

    def run_or_oom(work):  # type: ignore[no-untyped-def]
        results = run(work)
        oom = torch.OutOfMemoryError("CUDA out of memory (injected)")
        return [oom if item.request.id == "r0" else out for item, out in zip(work, results, strict=True)]

    engine.token2wav.run = run_or_oom  # type: ignore[method-assign]
    for spec in _specs(tiny_model):
        engine.add(spec)
    results: dict[str, RequestResult] = {}
    with caplog.at_level(logging.ERROR, "cosyserve.engine.engine"):
        drain(engine, results)
    assert isinstance(results["r0"].error, DeviceOutOfMemoryError)
    assert results["r1"].error is None and results["r1"].audio.size > 0
    assert not engine.has_work() and engine.lm_runner.cache.free_slots == engine.config.max_active == 2
    assert engine.stats.snapshot().failures == {"out_of_memory": 1}
    mapped = map_error(results["r0"].error)
    assert (mapped.http_status, mapped.code, mapped.retry_after_s) == (503, "out_of_memory", 1)
    assert "ran out of device memory" in caplog.text


def test_a_device_error_kills_the_engine_and_says_what_to_do(
    tiny_model: LoadedModel, caplog: pytest.LogCaptureFixture
) -> None:
    engine = make_engine(tiny_model, max_active=2)
    run = engine.token2wav.run

    def broken(work):  # type: ignore[no-untyped-def]
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered (injected)")

    engine.token2wav.run = broken  # type: ignore[method-assign]
    async_engine = AsyncEngine(engine)
    async_engine.start()

    async def consume() -> BaseException | None:
        try:
            async for _ in async_engine.generate(_specs(tiny_model)[0]):
                pass
        except EngineDeadError as exc:
            return exc
        return None

    try:
        with caplog.at_level(logging.ERROR, "cosyserve.engine.async_engine"):
            error = asyncio.run(consume())
            deadline = time.monotonic() + 10
            while async_engine.alive and time.monotonic() < deadline:
                time.sleep(0.01)
    finally:
        async_engine.shutdown()
        engine.token2wav.run = run  # type: ignore[method-assign]
    assert isinstance(error, EngineDeadError) and not async_engine.alive
    assert isinstance(async_engine.error, torch.AcceleratorError)
    assert "/ready answers 503; restart the process" in caplog.text
    assert not engine.has_work()
    assert isinstance(engine, Engine)
