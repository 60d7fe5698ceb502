"""The engine's thread: its torch thread count."""

import asyncio
from collections.abc import Iterator

import pytest
import torch

from cosyserve.engine.async_engine import AsyncEngine
from cosyserve.engine.request import StepOutput
from cosyserve.loader import LoadedModel
from tests.engine.helpers import make_engine, mixed_specs


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
