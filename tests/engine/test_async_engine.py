"""The engine's thread: its torch thread count, and a start that fails."""

import asyncio
from collections.abc import Iterator

import pytest
import torch

from cosyserve.bench.engine_runs import make_engine, mixed_specs
from cosyserve.engine import async_engine as async_engine_module
from cosyserve.engine.async_engine import AsyncEngine
from cosyserve.engine.loader import LoadedModel
from cosyserve.engine.request import StepOutput


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


def test_a_failed_start_leaves_a_dead_engine_not_a_hang(
    tiny_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing(count: int) -> None:
        raise RuntimeError("can't set the thread count")

    monkeypatch.setattr(async_engine_module, "pin_torch_threads", failing)
    engine = AsyncEngine(make_engine(tiny_model, max_active=2))
    engine.start()
    try:
        assert not engine.alive and isinstance(engine.error, RuntimeError)
    finally:
        engine.shutdown()
