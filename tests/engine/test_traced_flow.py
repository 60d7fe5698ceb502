"""The engine replays the streaming flow's estimator calls from traces on a CPU, made at
start (``EngineConfig.traced_flow``); ``tests/models/flow/test_traced_steps.py`` checks
the replays' bits."""

import threading

import pytest
import torch

from cosyserve.engine.config import EngineConfig
from cosyserve.engine.engine import Engine
from cosyserve.engine.loader import LoadedModel
from cosyserve.modeldir.presets import TINY
from cosyserve.models.flow import Flow
from cosyserve.weights.randomize import randomize_


def _flow() -> Flow:
    flow = Flow(TINY.flow)
    randomize_(flow, torch.Generator().manual_seed(0))
    return flow.eval()


@pytest.mark.parametrize(
    ("options", "traced"),
    [({}, True), ({"traced_flow": False}, False), ({"flow_cache": "exact"}, False)],
)
def test_engine_traces_the_streaming_flow_on_a_cpu_by_default(
    tiny_model: LoadedModel, options: dict[str, object], traced: bool
) -> None:
    flow = _flow()
    config = EngineConfig(max_active=2, max_len=256, traced_decode=False, **options)  # type: ignore[arg-type]
    Engine(tiny_model.lm, flow, tiny_model.hift, config)
    assert (flow.cfm.traced_steps is not None) is traced
    # Traced on a thread of its own: no thread but the caller's is left behind.
    assert not any(t.name == "cosyserve-trace" for t in threading.enumerate())
