"""A flow call's later Euler steps replayed on static buffers (``CFM.step_capture``) give
the eager steps' frames; calls with cached state are never captured."""

from collections.abc import Iterator

import pytest
import torch

from cosyserve.models.flow import Flow
from cosyserve.models.flow.rows import FlowRow, infer_rows
from cosyserve.models.flow.step_graph import CudaStepCapture, Step, eager_capture
from tests.models.flow.test_flow_rows import Voice


class CountingCapture:
    """:func:`eager_capture`, counting captures and replays."""

    def __init__(self) -> None:
        self.captures = 0
        self.replays = 0

    def __call__(self, step: Step) -> Step:
        self.captures += 1
        replay = eager_capture(step)

        def counted() -> torch.Tensor:
            self.replays += 1
            return replay()

        return counted


@pytest.fixture
def capture(flow: Flow) -> Iterator[CountingCapture]:
    counting = CountingCapture()
    flow.cfm.step_capture = counting
    try:
        yield counting
    finally:
        flow.cfm.step_capture = None


def _rows(voices: list[Voice], flow: Flow, streaming: bool) -> list[torch.Tensor]:
    rows = [FlowRow(v.tokens, v.prompt_token, v.prompt_feat, v.embedding, 0) for v in voices]
    return infer_rows(flow, rows, streaming=streaming, finalize=True)


@pytest.mark.parametrize("streaming", [False, True])
def test_replayed_steps_give_the_eager_steps_bits(
    flow: Flow, capture: CountingCapture, streaming: bool
) -> None:
    # Rows of different lengths: padded frames and an attention bias, read by every replay.
    voices = [Voice(prompt=6, tokens=20, seed=1), Voice(prompt=4, tokens=9, seed=2)]
    replayed = _rows(voices, flow, streaming)
    assert capture.captures == 1
    assert capture.replays == flow.cfg.cfm.n_timesteps - 1
    flow.cfm.step_capture = None
    for got, want in zip(replayed, _rows(voices, flow, streaming), strict=True):
        assert torch.equal(got, want)


def test_streams_with_cached_state_are_not_captured(flow: Flow, capture: CountingCapture) -> None:
    voice = Voice(prompt=6, tokens=30, seed=3)
    cache = flow.new_stream_cache()
    for chunk in voice.chunks():
        voice.stream_alone(flow, cache, chunk)
    assert capture.captures == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_graph_steps_match_eager_steps(flow: Flow) -> None:
    device = torch.device("cuda")
    voices = [Voice(prompt=6, tokens=20, seed=1), Voice(prompt=4, tokens=9, seed=2)]
    gpu = Flow(flow.cfg).eval()
    gpu.load_state_dict(flow.state_dict())
    gpu.to(device)
    for v in voices:
        for name in ("prompt_token", "prompt_feat", "embedding", "tokens"):
            setattr(v, name, getattr(v, name).to(device))
    capture = CudaStepCapture(device)  # one for every call, as the engine keeps it
    for streaming in (False, True, False):
        gpu.cfm.step_capture = None
        eager = _rows(voices, gpu, streaming)
        gpu.cfm.step_capture = capture
        replayed = _rows(voices, gpu, streaming)
        for got, want in zip(replayed, eager, strict=True):
            diff = (got - want).abs().max().item()
            print(f"streaming={streaming}: max |graph - eager| = {diff:.3g}, equal: {torch.equal(got, want)}")
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
