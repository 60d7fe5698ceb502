"""The engine on a CosyVoice 3 model: batched requests equal requests alone, the streamed
chunks are the flow's and the vocoder's own output, and the incremental stream caches
change nothing against recomputing every chunk as upstream does."""

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from cosyserve.accel.machine import Machine
from cosyserve.accel.plan import Choices, choose_plan
from cosyserve.accel.precision_choices import FlowQuantization, Profile
from cosyserve.accel.quantize import Fp16WeightLinear
from cosyserve.bench.engine_runs import make_engine, mixed_specs, run_alone, run_together, voices
from cosyserve.bench.workload import synthetic_spec, synthetic_text_ids
from cosyserve.engine import token2wav3
from cosyserve.engine.loader import LoadedModel, load_model
from cosyserve.engine.request import GenerationSpec, generators_for
from cosyserve.engine.token2wav3 import Token2Wav3
from cosyserve.models.dit import Flow3, Flow3PromptCache, stream_cache_bytes
from cosyserve.models.hift3 import CausalHiFTGenerator
from cosyserve.models.lm3 import CosyVoice3LM
from tests.engine.helpers import assert_same


@pytest.fixture(scope="module")
def model3(tiny3_model_dir: Path) -> LoadedModel:
    return load_model(tiny3_model_dir)


def test_a_cosyvoice3_directory_loads_its_own_modules(model3: LoadedModel) -> None:
    assert isinstance(model3.lm, CosyVoice3LM)
    assert isinstance(model3.flow, Flow3)
    assert isinstance(model3.hift, CausalHiFTGenerator)
    assert model3.features.speech_tokenizer is not None
    engine = make_engine(model3)
    assert isinstance(engine.token2wav, Token2Wav3)
    assert isinstance(engine.flow_prompt_cache, Flow3PromptCache)  # primed voice prompts


def test_requests_together_equal_requests_alone(model3: LoadedModel) -> None:
    specs = mixed_specs(model3, count=6)
    reference = run_alone(model3, specs, flow_cache="cached")
    together = run_together(make_engine(model3, max_active=4, flow_cache="cached"), specs)
    assert_same(together, reference, [s.request_id for s in specs])


def _stream_spec(model: LoadedModel, tokens: int, first_hop: int | None = None) -> GenerationSpec:
    voice = voices(model, 1)[0]
    return synthetic_spec(
        "s",
        voice,
        synthetic_text_ids(model.hparams, tokens, seed=3),
        tokens=tokens,
        seed=11,
        stream=True,
        first_hop=first_hop,
    )


@pytest.mark.parametrize("first_hop", [None, 8])
def test_cached_streams_equal_upstreams_recomputed_chunks(model3: LoadedModel, first_hop: int | None) -> None:
    """``cached`` keeps the flow's attention states and the vocoder's contexts between
    chunks; ``exact`` recomputes prompt and tokens for every chunk, as upstream. Same audio,
    chunk by chunk; ``incremental`` differs in its last chunk only."""
    spec = _stream_spec(model3, 140, first_hop)
    runs = {
        mode: run_alone(model3, [spec], flow_cache=mode)["s"] for mode in ("exact", "cached", "incremental")
    }
    exact, cached, incremental = runs["exact"], runs["cached"], runs["incremental"]
    assert len(exact.chunks) >= 3
    assert [c.size for c in cached.chunks] == [c.size for c in exact.chunks]
    for ours, theirs in zip(cached.chunks, exact.chunks, strict=True):
        assert float(np.abs(ours - theirs).max()) <= 1e-4
    assert [c.size for c in incremental.chunks] == [c.size for c in exact.chunks]
    for ours, theirs in zip(incremental.chunks[:-1], exact.chunks[:-1], strict=True):
        assert float(np.abs(ours - theirs).max()) <= 1e-4
    assert float(np.abs(incremental.chunks[-1] - exact.chunks[-1]).max()) > 1e-4


def test_non_streaming_audio_is_the_flow_and_vocoder_of_the_tokens(model3: LoadedModel) -> None:
    voice = voices(model3, 1)[0]
    spec = synthetic_spec("n", voice, synthetic_text_ids(model3.hparams, 40, seed=5), tokens=40, seed=2)
    result = run_alone(model3, [spec])["n"]
    assert result.tokens is not None and len(result.tokens) == 40
    flow, hift = model3.flow, model3.hift
    assert isinstance(flow, Flow3) and isinstance(hift, CausalHiFTGenerator)
    with torch.inference_mode():
        mel = flow.inference(
            torch.tensor(result.tokens)[None],
            voice.speech_tokens[None],
            voice.mel[None],
            voice.embedding[None],
            streaming=False,
            finalize=True,
        )
        # The vocoder's noise table comes from the request's own vocoder generator.
        noise_seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generators_for(spec.seed)[1]))
        wave, _ = hift.inference(mel, finalize=True, noise_seed=noise_seed)
    assert mel.shape[2] == 80
    assert result.audio.size == 80 * hift.cfg.upsample_factor
    assert float(np.abs(result.audio - wave[0].numpy()).max()) <= 1e-5


def test_the_plan_shows_what_a_cosyvoice3_flow_runs(tiny3_model_dir: Path) -> None:
    """CosyVoice 2's traced steps and packed layers do not exist for the DiT: a fast plan
    that picks them for this machine reads, once the model is known, as what actually
    runs. fp16 weights do: every DiT Linear, within docs/precision.md's tolerance."""
    plan = choose_plan(Machine.detect(), Profile.FAST, Choices(flow_quantize=FlowQuantization.FP16))
    model = load_model(tiny3_model_dir, plan)
    assert not (model.plan.traced_flow or model.plan.packed_bf16)
    assert model.plan.precision.quantize is plan.precision.quantize  # the LM's choices stay
    assert model.plan.precision.flow_quantize is FlowQuantization.FP16
    assert "with fp16 weights" in model.plan.precision.describe()
    assert isinstance(model.flow, Flow3)
    linears = [m for m in model.flow.cfm.estimator.modules() if isinstance(m, nn.Linear | Fp16WeightLinear)]
    assert linears and all(isinstance(m, Fp16WeightLinear) for m in linears)
    exact = load_model(tiny3_model_dir)
    assert isinstance(exact.flow, Flow3)
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, exact.flow.cfg.vocab_size, (1, 60), generator=gen)
    prompt = (tokens[:, :10], torch.randn(1, 20, 80, generator=gen), torch.randn(1, 192, generator=gen))
    want = exact.flow.inference(tokens[:, 10:], *prompt, False, True)
    got = model.flow.inference(tokens[:, 10:], *prompt, False, True)
    assert 0 < float((got - want).abs().max()) <= 0.01


def test_long_silences_are_cut_for_the_flow_as_upstream(model3: LoadedModel) -> None:
    """Upstream's CosyVoice 3 ``llm_job`` passes at most 5 silent tokens in a row to the
    flow; the LM still reads back every token it sampled."""
    cfg = model3.lm.cfg
    assert cfg.max_silent_run == 5
    silent = frozenset(cfg.silent_tokens)
    seg = make_engine(model3)._segment_state(_stream_spec(model3, 10), 0)
    sampled = [1, 2, 28, 29, 55, 248, 494, 7, 2241, 9]
    for token in sampled:
        seg.keep_token(token, silent, cfg.max_silent_run)
    assert seg.history == sampled
    assert seg.tokens == [1, 2, 28, 29, 55, 7, 2241, 9]


def test_a_stream_whose_cache_does_not_fit_recomputes_as_upstream(model3: LoadedModel) -> None:
    spec = _stream_spec(model3, 90)
    exact = run_alone(model3, [spec], flow_cache="exact")["s"]
    engine = make_engine(model3, max_active=1, flow_cache="cached", flow_stream_cache_mb=1)
    refused = run_together(engine, [spec])["s"]
    assert engine.stats.flow_cache_refusals == 1
    assert [c.size for c in refused.chunks] == [c.size for c in exact.chunks]
    assert float(np.abs(refused.audio - exact.audio).max()) <= 1e-5


@pytest.mark.parametrize(
    ("held", "dtype", "tol"), [("fp16", torch.float16, 2e-3), ("int8", torch.int8, 2e-2)]
)
def test_narrower_stream_caches_fit_more_streams_and_stay_close(
    model3: LoadedModel, held: str, dtype: torch.dtype, tol: float
) -> None:
    """With ``flow_cache_dtype`` ``fp16`` or ``int8`` (the fast float32 CPU plans') a stream
    reserves a half or about a quarter of the bytes (int8: a byte a value and a float32
    scale per head and frame): a budget too small for its float32 cache holds the narrower
    one, and the audio stays within docs/precision.md's tolerance of the float32 cache's."""
    spec = _stream_spec(model3, 90)
    assert isinstance(model3.flow, Flow3)
    d = model3.flow.cfg.dit.dim_head
    saved = 2.0 if dtype == torch.float16 else 4 * d / (d + 4)
    frames = (spec.flow_prompt_tokens.numel() + 90) * model3.flow.cfg.token_mel_ratio
    wide, narrow = (stream_cache_bytes(model3.flow, frames, d) for d in (None, dtype))
    budget_mb = -(-narrow // (1 << 20))
    assert narrow * saved == pytest.approx(wide) and wide > budget_mb << 20  # float32 cannot fit
    common = {"max_active": 1, "flow_prompt_cache_mb": 0}
    for cache_dtype, refusals in (("computed", 1), (held, 0)):
        engine = make_engine(model3, **common, flow_stream_cache_mb=budget_mb, flow_cache_dtype=cache_dtype)
        run_together(engine, [spec])
        assert engine.stats.flow_cache_refusals == refusals
    cached = run_together(make_engine(model3, **common, flow_cache_dtype=held), [spec])["s"]
    reference = run_together(make_engine(model3, **common), [spec])["s"]
    assert [c.size for c in cached.chunks] == [c.size for c in reference.chunks]
    assert 0 < float(np.abs(cached.audio - reference.audio).max()) <= tol


@pytest.mark.parametrize("prompt_cache_mb", [0, 64])
def test_streams_in_lockstep_share_flow_passes_and_equal_each_alone(
    model3: LoadedModel, prompt_cache_mb: int
) -> None:
    """Streams started together (one voice, one schedule, their own tokens and lengths)
    push their chunks through the DiT jointly; each stream's audio is what it gets alone."""
    voice = voices(model3, 1)[0]
    specs = [
        synthetic_spec(
            f"s{i}",
            voice,
            synthetic_text_ids(model3.hparams, 60, seed=i),
            tokens=60 + 10 * i,
            seed=50 + i,
            stream=True,
            first_hop=5,
        )
        for i in range(4)
    ]
    options = {"flow_cache": "incremental", "flow_prompt_cache_mb": prompt_cache_mb}
    want = run_alone(model3, specs, **options)
    engine = make_engine(model3, max_active=4, **options)
    got = run_together(engine, specs)
    for spec in specs:
        ours, alone = got[spec.request_id], want[spec.request_id]
        assert ours.error is None and ours.tokens == alone.tokens
        assert [c.size for c in ours.chunks] == [c.size for c in alone.chunks]
        # A joint pass rounds its products differently (mel within 1e-5, see
        # tests/models/cosyvoice3/test_flow_stream.py); the causal vocoder's phase carries
        # that to about 1e-4 in the samples.
        assert float(np.abs(ours.audio - alone.audio).max()) <= 5e-4
    assert engine.stats.flow_rows > engine.stats.flow_calls  # some passes held several streams


def test_a_failed_joint_pass_runs_its_streams_alone(
    model3: LoadedModel, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    voice = voices(model3, 1)[0]
    text = synthetic_text_ids(model3.hparams, 60, seed=1)
    specs = [
        synthetic_spec(f"s{i}", voice, text, tokens=60, seed=i, stream=True, first_hop=5) for i in range(2)
    ]
    want = run_alone(model3, specs, flow_cache="incremental")

    def broken(*args: object) -> None:
        raise RuntimeError("injected")

    monkeypatch.setattr(token2wav3, "push_streams", broken)
    engine = make_engine(model3, max_active=2, flow_cache="incremental")
    got = run_together(engine, specs)
    assert_same(got, want, ["s0", "s1"])
    assert engine.stats.flow_rows == engine.stats.flow_calls
    assert "a joint flow pass of 2 streams failed" in caplog.text
