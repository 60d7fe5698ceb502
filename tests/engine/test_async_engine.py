"""The engine's thread: its torch thread count, and the memory it pretouches at start."""

import asyncio
import threading
from collections.abc import Iterator

import pytest
import torch

from cosyserve.bench.engine_runs import make_engine, mixed_specs
from cosyserve.engine import async_engine as async_engine_module
from cosyserve.engine.async_engine import AsyncEngine
from cosyserve.engine.loader import LoadedModel
from cosyserve.engine.request import StepOutput
from cosyserve.memory import pretouch


@pytest.fixture(autouse=True)
def restore_process_count() -> Iterator[None]:
    """The engine thread's pin also sets torch's process-wide count; later tests get theirs back."""
    count = torch.get_num_threads()
    yield
    torch.set_num_threads(count)


def test_the_engine_thread_runs_on_the_count_it_was_given(tiny_model: LoadedModel) -> None:
    engine = make_engine(tiny_model, max_active=2)
    counts: set[int] = set()
    step = engine.step

    def counting_step() -> list[StepOutput]:
        counts.add(torch.get_num_threads())
        return step()

    engine.step = counting_step  # type: ignore[method-assign]
    async_engine = AsyncEngine(engine, threads=3)
    async_engine.start()

    async def run() -> int:
        return sum([chunk.audio.size async for chunk in async_engine.generate(mixed_specs(tiny_model, 1)[0])])

    try:
        assert asyncio.run(run()) > 0
    finally:
        async_engine.shutdown()
    assert counts == {3}


def test_an_engine_thread_needs_a_thread(tiny_model: LoadedModel) -> None:
    with pytest.raises(ValueError, match="at least one"):
        AsyncEngine(make_engine(tiny_model, max_active=1), threads=0)


def test_start_returns_once_the_engine_thread_has_pretouched(
    tiny_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[str, int]] = []

    def recorded(nbytes: int) -> int:
        faults = pretouch(nbytes)
        calls.append((threading.current_thread().name, nbytes))
        return faults

    monkeypatch.setattr(async_engine_module, "pretouch", recorded)
    engine = AsyncEngine(make_engine(tiny_model, max_active=2, pretouch_mb=64))
    engine.start()
    try:
        assert calls == [("cosyserve-engine", 64 << 20)] and engine.alive
    finally:
        engine.shutdown()


def test_a_failed_pretouch_leaves_a_dead_engine_not_a_hang(
    tiny_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing(nbytes: int) -> int:
        raise RuntimeError("can't allocate memory")

    monkeypatch.setattr(async_engine_module, "pretouch", failing)
    engine = AsyncEngine(make_engine(tiny_model, max_active=2, pretouch_mb=1 << 20))
    engine.start()
    try:
        assert not engine.alive and isinstance(engine.error, RuntimeError)
    finally:
        engine.shutdown()
