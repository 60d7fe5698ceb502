"""A random tiny flow, run on one torch thread."""

from collections.abc import Iterator

import pytest
import torch

from cosyserve.modeldir.presets import TINY
from cosyserve.models.flow import Flow
from cosyserve.weights.randomize import randomize_


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    # Tiny tensors: a second intra-op thread only adds synchronisation on shared CPUs.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def flow() -> Flow:
    model = Flow(TINY.flow)
    randomize_(model, torch.Generator().manual_seed(0))
    return model.eval()
