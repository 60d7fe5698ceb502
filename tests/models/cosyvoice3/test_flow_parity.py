"""Numerical parity of the CosyVoice 3 flow against upstream ``CausalMaskedDiffWithDiT``
(FunAudioLLM/CosyVoice ace7c47), through committed fixtures made by
``make_flow_fixtures.py``: our :class:`Flow3` is rebuilt from the same preset and seed."""

from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch

from cosyserve.models.dit import Flow3, flow3_checkpoint_table
from cosyserve.weights.checkpoint import load_checkpoint, to_checkpoint
from tests.models.cosyvoice3.make_flow_fixtures import (
    FIXTURES,
    FULL_CASE,
    TINY_CASE,
    Geometry,
    our_flow,
    stream_calls,
)

pytestmark = pytest.mark.parity

TOLERANCE = 1e-4


@cache
def fixture(case: Geometry) -> dict[str, Any]:
    data: dict[str, Any] = torch.load(FIXTURES / f"flow-{case.name}.pt", weights_only=True)
    return data


@cache
def flow(case: Geometry, fixed_time: bool = False) -> Flow3:
    """Our flow; ``fixed_time``: as the loader leaves it, its sampler's time conditioning
    computed once and the DiT's time layers released."""
    model = our_flow(case.hp.flow)
    if fixed_time:
        model.cfm.fix_time_conditioning(torch.float32)
        model.cfm.estimator.release_time_layers()
    return model


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max())


def check_table(case: Geometry) -> None:
    """The table covers exactly upstream's state-dict keys (in its order), each mapped to
    one of our tensors of the same shape."""
    with torch.device("meta"):
        ours = Flow3(case.hp.flow)
    own = ours.state_dict()
    table = flow3_checkpoint_table(case.hp.flow)
    expected = [(key, tuple(shape)) for key, shape in fixture(case)["state_shapes"]]
    assert [(c, tuple(own[m].shape)) for c, m in table.entries] == expected


def check_non_streaming(case: Geometry, fixed_time: bool = False) -> None:
    x, data = fixture(case)["inputs"], fixture(case)
    model = flow(case, fixed_time)
    got = model.inference(x["token"], x["prompt_token"], x["prompt_feat"], x["embedding"], False, True)
    assert got.dtype == torch.float32
    assert float(data["mel_prompt"].std()) > 0.1  # random weights still give a non-trivial mel
    diff = max_abs_diff(got, data["mel_prompt"])
    assert diff <= TOLERANCE, f"with prompt: max abs diff {diff:.3g}"
    empty_token, empty_feat = x["prompt_token"][:, :0], x["prompt_feat"][:, :0]
    got = model.inference(x["token"], empty_token, empty_feat, x["embedding"], False, True)
    diff = max_abs_diff(got, data["mel_no_prompt"])
    assert diff <= TOLERANCE, f"without prompt: max abs diff {diff:.3g}"


def check_streaming(case: Geometry, fixed_time: bool = False) -> None:
    x, data = fixture(case)["inputs"], fixture(case)
    model, ratio = flow(case, fixed_time), case.hp.flow.token_mel_ratio
    calls = stream_calls(case.prompt_tokens, case.tokens)
    assert len(calls) == len(data["stream_chunks"])
    for call, expected in zip(calls, data["stream_chunks"], strict=True):
        token = x["token"][:, : call.end]
        # As upstream's token2wav: the final call runs without streaming (full attention).
        mel = model.inference(
            token, x["prompt_token"], x["prompt_feat"], x["embedding"], not call.finalize, call.finalize
        )
        diff = max_abs_diff(mel[:, :, call.offset * ratio :], expected)
        assert diff <= TOLERANCE, f"{call}: max abs diff {diff:.3g}"
    last = calls[-1]
    mel = model.inference(x["token"], x["prompt_token"], x["prompt_feat"], x["embedding"], True, True)
    diff = max_abs_diff(mel[:, :, last.offset * ratio :], data["causal_last_chunk"])
    assert diff <= TOLERANCE, f"chunk-causal last call: max abs diff {diff:.3g}"


def test_stream_calls_follow_the_hop_schedule() -> None:
    # 10 prompt tokens: the first hop is 25 + 15 so that 10 + 40 ends on a chunk boundary;
    # then hops of 50 and 100 tokens; each call but the last carries 3 look-ahead tokens.
    ends = [(c.end, c.offset, c.finalize) for c in stream_calls(10, 240)]
    assert ends == [(43, 0, False), (93, 40, False), (193, 90, False), (240, 190, True)]
    assert [(c.end, c.offset) for c in stream_calls(25, 60)] == [(28, 0), (60, 25)]


def test_table_matches_upstream_state_dict() -> None:
    check_table(TINY_CASE)


def test_checkpoint_round_trip_through_the_table(tmp_path: Path) -> None:
    """``flow.pt`` written through the table loads back into an equal module."""
    source, table = flow(TINY_CASE), flow3_checkpoint_table(TINY_CASE.hp.flow)
    path = tmp_path / "flow.pt"
    torch.save(to_checkpoint(source, table), path)
    loaded = Flow3(TINY_CASE.hp.flow)
    load_checkpoint(loaded, path, table)
    expected = source.state_dict()
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, expected[key]), key


@pytest.mark.parametrize("fixed_time", [False, True])
def test_non_streaming_mel_matches_upstream(fixed_time: bool) -> None:
    check_non_streaming(TINY_CASE, fixed_time)


@pytest.mark.parametrize("fixed_time", [False, True])
def test_streaming_chunks_match_upstream(fixed_time: bool) -> None:
    check_streaming(TINY_CASE, fixed_time)


def test_released_time_layers_refuse_to_run_without_the_fixed_conditioning() -> None:
    x = fixture(TINY_CASE)["inputs"]
    model = our_flow(TINY_CASE.hp.flow)
    model.cfm.fix_time_conditioning(torch.float32)
    model.cfm.estimator.release_time_layers()
    with pytest.raises(RuntimeError, match="time layers were released"):
        model.double().inference(  # no conditioning fixed for float64
            x["token"], x["prompt_token"], x["prompt_feat"], x["embedding"], False, True
        )


@pytest.mark.slow
def test_full_table_matches_upstream_state_dict() -> None:
    check_table(FULL_CASE)


@pytest.mark.slow
@pytest.mark.parametrize("fixed_time", [False, True])
def test_full_geometry_matches_upstream(fixed_time: bool) -> None:
    check_non_streaming(FULL_CASE, fixed_time)
    check_streaming(FULL_CASE, fixed_time)
