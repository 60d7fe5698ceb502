"""CosyVoice 3 end to end against upstream's ``CosyVoice3Model``: text ids -> speech tokens ->
waveform, non-streaming and streaming, from committed fixtures.

The fixture (``fixtures/cosyvoice3-e2e.pt``) was made by ``make_cosyvoice3_fixtures.py``
from upstream FunAudioLLM/CosyVoice at commit ace7c47 with::

    COSYVOICE3_UPSTREAM=/tmp/upstream COSYVOICE3_SITE=/tmp/upv3-site OMP_NUM_THREADS=1 \\
        .venv/bin/python -m tests.pipeline.make_cosyvoice3_fixtures

It ran upstream's own ``tts`` (its LM thread, its chunk loop with the hop growing 25 + pad,
50, 100, and ``CosyVoice3Model.token2wav``) on the tiny directory of ``cosyserve model init
DIR --family cosyvoice3 --size tiny --seed 0``, zero-shot with our voice prompt features and
our LM ids (the prompt text holds ``<|endofprompt|>``), its random draws made ours: the LM's
``multinomial`` draws from the uniforms of the request's LM generator
(``engine.request.generators_for(seed)``; two per step, the second for the repetition
fallback, which bans the repeated token), a forced length, and the vocoder noise table
replaced by our ``noise_window`` of the request's noise seed (the first draw of its vocoder
generator). The flow's noise is a fixed table in both.

Our side needs no hook: the engine draws from those same generators. Here the directory is
regenerated (its manifest must equal the fixture's), loaded with the exact profile, and our
engine runs the fixture's inputs; checked: the same tokens, the same ``token2wav`` chunk
schedule, chunk sizes, and audio within 1e-4 (``flow_cache`` "exact" and "cached" for the
stream: both promise upstream's output).

Measured when made (CPU, one thread): the same tokens (60 and 190, the fallback's banned
draw taken 3 times and once); the flow's mel on the same tokens identical (diff 0); audio
max abs diff 5.9e-05 non-streaming, per chunk at most 6.1e-05 ("exact") and 6.3e-05
("cached") streaming, all of it from the vocoder (our vocoder on upstream's mel: 5.9e-05;
mean diff 4e-7, the largest at a sample of -0.74: rounding, not a drift; the vocoder's
stage test, with quietened weights, stays under 1e-6).

Not covered: ``CosyVoice3Model.llm_job`` keeps at most 5 silent tokens in a row from the
flow, which our engine does not; the fixture holds no such run.

Random tiny weights clip part of the waveform at 0.99 (upstream's ``audio_limit``; about
a tenth of the samples); the rest carries the signal compared.
"""

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from cosyserve.bench.engine_runs import RequestResult, drain
from cosyserve.engine.chunking import UPSTREAM_MAX_HOP, ChunkSchedule
from cosyserve.engine.config import FlowCacheMode
from cosyserve.engine.engine import Engine
from cosyserve.engine.loader import LoadedModel, engine_config_for, load_model
from cosyserve.engine.request import GenerationSpec, Segment, generators_for
from cosyserve.modeldir.layout import MANIFEST_FILE
from cosyserve.models.dit import Flow3
from cosyserve.models.generate import init_model_dir
from cosyserve.models.hift3 import CausalHiFTGenerator
from cosyserve.pipeline.frontend import Frontend
from cosyserve.pipeline.request import Mode, SynthesisOptions, SynthesisRequest
from tests.pipeline.prompts import PROMPT_TEXT, prompt_wav

pytestmark = pytest.mark.parity
log = logging.getLogger(__name__)

FIXTURE = Path(__file__).parent / "fixtures" / "cosyvoice3-e2e.pt"
TOLERANCE = 1e-4
ENDOFPROMPT_ID = 151646


@pytest.fixture(scope="module")
def fixture() -> dict[str, Any]:
    data: dict[str, Any] = torch.load(FIXTURE, weights_only=True)
    return data


@pytest.fixture(scope="module")
def model3(tmp_path_factory: pytest.TempPathFactory, fixture: dict[str, Any]) -> LoadedModel:
    """The fixture's model directory, made again by ``cosyserve model init``'s function."""
    path = tmp_path_factory.mktemp("models") / "tiny3"
    init_model_dir(path, "tiny", seed=fixture["model_seed"], family="cosyvoice3")
    assert (path / MANIFEST_FILE).read_text() == fixture["manifest"], "init no longer makes the same bytes"
    return load_model(path)


def _spec(fixture: dict[str, Any], name: str) -> GenerationSpec:
    case = fixture[name]
    return GenerationSpec(
        request_id=name,
        segments=(Segment(text_ids=tuple(case["text_ids"].tolist())),),
        embedding=fixture["embedding"],
        flow_prompt_tokens=fixture["flow_prompt_tokens"],
        flow_prompt_mel=fixture["flow_prompt_mel"],
        lm_prefix_ids=tuple(case["lm_prefix_ids"].tolist()),
        lm_prompt_speech=tuple(case["lm_prompt_speech"].tolist()),
        seed=case["seed"],
        stream=case["stream"],
        min_tokens=case["token_count"],
        max_tokens=case["token_count"],
    )


def _run(model: LoadedModel, spec: GenerationSpec, flow_cache: FlowCacheMode) -> RequestResult:
    """``spec`` alone in an engine as the exact profile configures it, upstream's hop growth on."""
    config = engine_config_for(model, flow_cache=flow_cache, hop_growth=True, first_hop=None)
    engine = Engine(model.lm, model.flow, model.hift, config)
    results: dict[str, RequestResult] = {}
    engine.add(spec)
    drain(engine, results)
    result = results[spec.request_id]
    assert result.finished and result.error is None, result.error
    return result


def _compare(
    ours: RequestResult, case: dict[str, Any], request: pytest.FixtureRequest, tag: str
) -> list[float]:
    assert ours.tokens is not None
    assert list(ours.tokens) == case["tokens"].tolist()
    assert [c.size for c in ours.chunks] == [c.numel() for c in case["chunks"]]
    diffs = []
    for index, (got, want) in enumerate(zip(ours.chunks, case["chunks"], strict=True)):
        diff = float(np.abs(got - want.numpy()).max())
        diffs.append(diff)
        request.node.user_properties.append((f"{tag} chunk {index}", diff))
        log.info("%s chunk %d (%d samples): max abs diff %.3g", tag, index, got.size, diff)
    assert max(diffs) <= TOLERANCE, f"{tag}: max abs diffs per chunk {diffs}"
    return diffs


def test_the_fixture_is_what_it_claims(fixture: dict[str, Any]) -> None:
    """Upstream's inputs carry the marker it asserts; its noise tables are our requests';
    the random parts it was made with were exercised (the repetition fallback); the
    streamed schedule is upstream's grown hops (30, 50, 100, final)."""
    assert fixture["upstream_commit"] == "ace7c47"
    for name in ("non_streaming", "streaming"):
        case = fixture[name]
        assert ENDOFPROMPT_ID in case["lm_prefix_ids"].tolist()
        assert case["tokens"].numel() == case["token_count"]
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generators_for(case["seed"])[1]))
        assert seed == case["noise_seed"]
        assert case["fallbacks"] >= 1
        audio = torch.cat(case["chunks"])
        assert float((audio.abs() >= 0.99).float().mean()) < 0.2  # mostly unclipped signal
    calls = fixture["streaming"]["token2wav_calls"]
    assert [offset for _, offset, _ in calls] == [0, 30, 80, 180]


def test_our_chunk_schedule_is_upstreams_token2wav_calls(fixture: dict[str, Any]) -> None:
    """Upstream's loop over all tokens made these calls: (tokens seen, offset, finalize)."""
    case = fixture["streaming"]
    prompt = int(fixture["flow_prompt_tokens"].numel())
    schedule = ChunkSchedule(prompt, hop=25, lookahead=3, max_hop=UPSTREAM_MAX_HOP)
    calls = []
    while (chunk := schedule.next_chunk(case["token_count"], finished=True)) is not None:
        calls.append((chunk.token_end, chunk.offset, chunk.finalize))
    assert calls == [tuple(c) for c in case["token2wav_calls"]]


def test_our_frontend_makes_the_fixtures_inputs(model3: LoadedModel, fixture: dict[str, Any]) -> None:
    """The inputs are our frontend's for the fixture's text and prompt (the LM ids exactly;
    the prompt's speech tokens exactly, its mel and embedding to float rounding)."""
    frontend = Frontend(model3)
    voice = frontend.voice_from_audio(prompt_wav(), PROMPT_TEXT)
    case = fixture["non_streaming"]
    options = SynthesisOptions(
        seed=case["seed"], min_tokens=case["token_count"], max_tokens=case["token_count"]
    )
    spec = frontend.build_spec(SynthesisRequest(fixture["text"], Mode.ZERO_SHOT, voice, options=options), "x")
    assert spec.lm_prefix_ids == tuple(case["lm_prefix_ids"].tolist())
    assert spec.segments[0].text_ids == tuple(case["text_ids"].tolist())
    assert spec.lm_prompt_speech == tuple(case["lm_prompt_speech"].tolist())
    assert torch.equal(spec.flow_prompt_tokens, fixture["flow_prompt_tokens"])
    torch.testing.assert_close(spec.flow_prompt_mel, fixture["flow_prompt_mel"], rtol=0, atol=1e-4)
    torch.testing.assert_close(spec.embedding, fixture["embedding"], rtol=0, atol=1e-4)


def test_non_streaming_matches_upstream(
    model3: LoadedModel, fixture: dict[str, Any], request: pytest.FixtureRequest
) -> None:
    """60 tokens from the same uniforms, then one flow + vocoder call over all of them."""
    ours = _run(model3, _spec(fixture, "non_streaming"), "exact")
    _compare(ours, fixture["non_streaming"], request, "non-streaming")


def test_non_streaming_stages_match_upstream(
    model3: LoadedModel, fixture: dict[str, Any], request: pytest.FixtureRequest
) -> None:
    """Where the end-to-end difference comes from: our flow on upstream's tokens against
    upstream's mel, and our vocoder on upstream's mel against upstream's audio."""
    case = fixture["non_streaming"]
    flow, hift = model3.flow, model3.hift
    assert isinstance(flow, Flow3) and isinstance(hift, CausalHiFTGenerator)
    with torch.inference_mode():
        mel = flow.inference(
            case["tokens"].long()[None],
            fixture["flow_prompt_tokens"][None],
            fixture["flow_prompt_mel"][None],
            fixture["embedding"][None],
            streaming=False,
            finalize=True,
        )
        wave, _ = hift.inference(case["mel"][None], finalize=True, noise_seed=case["noise_seed"])
    mel_diff = float((mel[0] - case["mel"]).abs().max())
    (want,) = case["chunks"]
    wave_diff = float((wave[0] - want).abs().max())
    for name, diff in (("flow mel", mel_diff), ("vocoder on upstream's mel", wave_diff)):
        request.node.user_properties.append((name, diff))
        log.info("non-streaming %s: max abs diff %.3g", name, diff)
    assert mel_diff <= TOLERANCE and wave_diff <= TOLERANCE, (mel_diff, wave_diff)


@pytest.mark.parametrize("flow_cache", ["exact", "cached"])
def test_streaming_matches_upstream_chunk_by_chunk(
    model3: LoadedModel, fixture: dict[str, Any], flow_cache: FlowCacheMode, request: pytest.FixtureRequest
) -> None:
    """190 tokens, streamed in upstream's chunks: 30 (25 + 5 to the block grid), 50, 100 and
    the final 10."""
    ours = _run(model3, _spec(fixture, "streaming"), flow_cache)
    _compare(ours, fixture["streaming"], request, f"streaming {flow_cache}")
