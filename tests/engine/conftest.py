"""The tiny model, loaded once for the engine tests, which run on one torch thread."""

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from cosyserve.engine.loader import LoadedModel, load_model


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir: Path) -> LoadedModel:
    return load_model(tiny_model_dir)


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    # The tiny model's ops are too small to split; on a shared machine a second intra-op
    # thread mostly spins (measured: several times slower under load).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
