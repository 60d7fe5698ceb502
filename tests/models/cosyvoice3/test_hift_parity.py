"""Numerical parity of the CosyVoice 3 vocoder against upstream ``CausalHiFTGenerator``
(FunAudioLLM/CosyVoice ace7c47), through committed fixtures made by
``make_hift_fixtures.py``: our :class:`CausalHiFTGenerator` is rebuilt from the same preset
and seed, and reads the same noise table upstream was given."""

import itertools
import logging
from functools import cache
from typing import Any

import pytest
import torch

from cosyserve.models.hift3 import CausalHiFTGenerator, CausalHiFTStream, causal_hift_checkpoint_table
from cosyserve.weights.checkpoint import to_checkpoint
from tests.models.cosyvoice3.make_hift_fixtures import (
    CHUNK_TOKENS,
    FIXTURES,
    FULL_CASE,
    NOISE_SEED,
    TINY_CASE,
    Geometry,
    our_hift,
)

pytestmark = pytest.mark.parity
log = logging.getLogger(__name__)

TOLERANCE = 1e-4
TAGS = {True: "final", False: "partial"}


@cache
def fixture(case: Geometry) -> dict[str, Any]:
    data: dict[str, Any] = torch.load(FIXTURES / f"hift-{case.name}.pt", weights_only=True)
    return data


@cache
def hift(case: Geometry) -> CausalHiFTGenerator:
    return our_hift(case.hp.hift)


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max())


def check(request: pytest.FixtureRequest, name: str, ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Assert parity; keep the measured difference (junit properties, --log-cli-level=INFO)."""
    diff = max_abs_diff(ours, theirs)
    request.node.user_properties.append((name, diff))
    log.info("%s: %s max-abs-diff %.3g", request.node.name, name, diff)
    assert diff <= TOLERANCE, f"{name}: max abs diff {diff:.3g}"


def check_table(case: Geometry) -> None:
    """What our table writes is exactly upstream's state dict: keys, order and shapes."""
    written = to_checkpoint(hift(case), causal_hift_checkpoint_table(case.hp.hift))
    expected = [(key, tuple(shape)) for key, shape in fixture(case)["state_shapes"]]
    assert sorted((k, tuple(v.shape)) for k, v in written.items()) == sorted(expected)


def check_f0(case: Geometry, request: pytest.FixtureRequest) -> None:
    data, model = fixture(case), hift(case)
    mel = data["mel"][:, :, : data["frames"]].to(torch.float64)
    for finalize, tag in TAGS.items():
        with torch.inference_mode():
            state = model.f0_predictor.new_state(1, mel)
            f0 = model.f0_predictor.step(mel, state, final=finalize)
        assert f0.dtype == torch.float64
        check(request, f"f0 {tag}", f0, data[f"f0_{tag}"])
    assert float((data["f0_final"] > case.hp.hift.nsf_voiced_threshold).double().mean()) > 0.5


def check_decode_same_source(case: Geometry, request: pytest.FixtureRequest) -> None:
    """Upstream's excitation fed to our decode."""
    data, model, cfg = fixture(case), hift(case), case.hp.hift
    mel = data["mel"][:, :, : data["frames"]]
    for finalize, tag in TAGS.items():
        decoder_mel = mel if finalize else mel[:, :, : mel.shape[2] - 3]
        wave = model.decode(decoder_mel, data[f"source_{tag}"], finalize)
        assert float(data[f"wave_{tag}"].abs().max()) < cfg.audio_limit  # nothing clipped
        check(request, f"decode {tag}", wave, data[f"wave_{tag}"])


def check_inference(case: Geometry, request: pytest.FixtureRequest) -> None:
    """Mel to waveform, our source from the noise table upstream was given."""
    data, model = fixture(case), hift(case)
    mel = data["mel"][:, :, : data["frames"]]
    for finalize, tag in TAGS.items():
        wave, source = model.inference(mel, finalize, noise_seed=NOISE_SEED)
        check(request, f"source {tag}", source, data[f"source_{tag}"])
        check(request, f"wave {tag}", wave, data[f"wave_{tag}"])


def check_stream_given_source(case: Geometry, request: pytest.FixtureRequest) -> None:
    """Upstream's excitation of one final call, vocoded by our stream in uneven pieces."""
    data, model, up = fixture(case), hift(case), case.hp.hift.upsample_factor
    mel, source = data["mel"][:, :, : data["frames"]], data["source_final"]
    bounds = (0, 11, 12, 29, mel.shape[2])
    stream = CausalHiFTStream(model)
    pieces = [
        stream.push(mel[:, :, a:b], finalize=b == bounds[-1], source=source[:, :, a * up : b * up])
        for a, b in itertools.pairwise(bounds)
    ]
    check(request, "stream given source", torch.cat(pieces, dim=1), data["wave_final"])


def check_stream(case: Geometry, request: pytest.FixtureRequest) -> None:
    """Our stateful stream, chunk by chunk, against upstream's ``token2wav`` re-running the
    vocoder over all accumulated mel per chunk."""
    data, model = fixture(case), hift(case)
    mel, chunks = data["mel"], data["chunks"]
    stream = CausalHiFTStream(model, noise_seed=NOISE_SEED)
    start = 0
    for index, (tokens, theirs) in enumerate(zip(chunks, data["stream"], strict=True)):
        frames = 2 * tokens
        ours = stream.push(mel[:, :, start : start + frames], finalize=index == len(chunks) - 1)
        start += frames
        check(request, f"stream chunk {index}", ours, theirs)
    assert stream.finished and start == mel.shape[2]


@pytest.mark.parametrize(
    "check_case",
    [check_table, check_f0, check_decode_same_source, check_inference, check_stream_given_source],
)
def test_tiny(check_case: Any, request: pytest.FixtureRequest) -> None:
    if check_case is check_table:
        check_table(TINY_CASE)
    else:
        check_case(TINY_CASE, request)


def test_tiny_stream_matches_upstream_redecoding(request: pytest.FixtureRequest) -> None:
    assert fixture(TINY_CASE)["chunks"][0] == CHUNK_TOKENS
    check_stream(TINY_CASE, request)


def test_stream_chunking_does_not_change_the_samples() -> None:
    """Any split of the mel gives the same samples as one final call (to float rounding)."""
    model, mel = hift(TINY_CASE), fixture(TINY_CASE)["mel"][:, :, :37]
    whole, _ = model.inference(mel, True, noise_seed=1)
    for bounds in ((0, 1, 2, 9, 10, 37), (0, 12, 13, 30, 37), (0, 37)):
        stream = CausalHiFTStream(model, noise_seed=1)
        pieces = [
            stream.push(mel[:, :, a:b], finalize=b == bounds[-1]) for a, b in itertools.pairwise(bounds)
        ]
        assert max_abs_diff(torch.cat(pieces, dim=1), whole) <= TOLERANCE


@pytest.mark.slow
def test_full_table() -> None:
    check_table(FULL_CASE)


@pytest.mark.slow
def test_full_f0_decode_inference(request: pytest.FixtureRequest) -> None:
    check_f0(FULL_CASE, request)
    check_decode_same_source(FULL_CASE, request)
    check_inference(FULL_CASE, request)


@pytest.mark.slow
def test_full_stream_matches_upstream_redecoding(request: pytest.FixtureRequest) -> None:
    check_stream(FULL_CASE, request)
