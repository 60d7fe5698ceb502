"""Make the CosyVoice 3 end-to-end parity fixture from upstream FunAudioLLM/CosyVoice at commit ace7c47.

Command (from the repository root; about a minute on one core)::

    COSYVOICE3_UPSTREAM=/tmp/upstream COSYVOICE3_SITE=/tmp/upv3-site OMP_NUM_THREADS=1 \\
        .venv/bin/python -m tests.pipeline.make_cosyvoice3_fixtures

What it does (writes ``fixtures/cosyvoice3-e2e.pt``):

1. writes the tiny CosyVoice 3 directory as ``cosyserve model init DIR --family cosyvoice3
   --size tiny --seed 0`` does (byte-reproducible: its ``manifest.sha256`` goes into the
   fixture, and the test regenerates the directory and checks it) and loads it with our
   loader, only to make the inputs with our frontend: the voice prompt of
   ``tests/pipeline/prompts.py`` (speech tokens, mel, CAM++ embedding) and the zero-shot
   LM ids of :data:`TEXT` (the prompt text opens with CosyVoice 3's system prompt, so it
   holds ``<|endofprompt|>``, id 151646, which upstream asserts);
2. builds upstream's ``CosyVoice3Model`` from that directory's ``cosyvoice3.yaml`` with
   hyperpyyaml (sections llm, flow, hift) and ``CosyVoice3Model.load`` (strict) of its
   llm.pt, flow.pt and hift.pt (the Qwen2 body in float32 first, see
   ``tests/pipeline/upstream_model.py``);
3. makes upstream's random draws ours, per request seed (``engine.request.generators_for``):
   ``torch.Tensor.multinomial`` draws by inverse CDF from the uniforms of the request's LM
   generator (two per step, the second for ras_sampling's fallback, which in ace7c47 bans
   the repeated token); the length is forced (every stop id masked below it); the decode
   step's mask is all ones (transformers 5); the vocoder's noise table (``sine_waves``, drawn
   from the global RNG when built) becomes our :func:`noise_window` of the request's noise
   seed, the first draw of its vocoder generator. The flow's noise is fixed in both;
4. runs upstream's own ``tts`` (``CosyVoice2Model.tts``, with its LM thread, chunk loop and
   ``CosyVoice3Model.token2wav``) zero-shot, (a) non-streaming with :data:`TOKENS` tokens
   and (b) streaming with :data:`STREAM_TOKENS` tokens (hop 25 + 5 prompt pad, then 50,
   then 100, then the final 10), and saves the inputs, the LM's tokens, every
   ``token2wav`` call, the audio (one array per chunk) and, non-streaming, the flow's mel.

``CosyVoice3Model.llm_job`` keeps at most 5 silent tokens in a row from the flow; our
engine keeps every token. No such run occurs here (checked: the flow saw the LM's tokens).
"""

import argparse
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from cosyserve.engine.loader import load_model
from cosyserve.engine.request import GenerationSpec, generators_for
from cosyserve.modeldir.layout import MANIFEST_FILE
from cosyserve.models.generate import init_model_dir
from cosyserve.models.hift3 import noise_window
from cosyserve.pipeline.frontend import Frontend
from cosyserve.pipeline.request import Mode, SynthesisOptions, SynthesisRequest
from tests.pipeline.prompts import PROMPT_TEXT, prompt_wav
from tests.pipeline.upstream_model import UniformMultinomial, forced_length, full_mask_step, recording_tokens

FIXTURE = Path(__file__).parent / "fixtures" / "cosyvoice3-e2e.pt"
MODEL_SEED = 0
TEXT = "Parity, end to end, for CosyVoice three."
# Non-streaming: one call over every token.
TOKENS, SEED = 60, 33
# Streaming, 20 prompt tokens: 30 (25 + 5 to the block grid), 50, 100, final 10.
STREAM_TOKENS, STREAM_SEED = 190, 34
ENDOFPROMPT_ID = 151646


def make_model_dir(path: Path) -> Path:
    """The tiny CosyVoice 3 directory of ``cosyserve model init --family cosyvoice3 --size
    tiny --seed 0``."""
    init_model_dir(path, "tiny", seed=MODEL_SEED, family="cosyvoice3")
    return path


def our_spec(model_dir: Path, seed: int, tokens: int, stream: bool) -> GenerationSpec:
    frontend = Frontend(load_model(model_dir))
    voice = frontend.voice_from_audio(prompt_wav(), PROMPT_TEXT)
    options = SynthesisOptions(seed=seed, min_tokens=tokens, max_tokens=tokens)
    request = SynthesisRequest(TEXT, Mode.ZERO_SHOT, voice, stream=stream, options=options)
    return frontend.build_spec(request, "parity")


def noise_seed(seed: int) -> int:
    """The noise table our engine gives a request of ``seed`` (engine.token2wav3)."""
    return int(torch.randint(0, 2**31 - 1, (1,), generator=generators_for(seed)[1]))


def build_upstream_model(model_dir: Path) -> Any:
    """Upstream's ``CosyVoice3Model`` over ``model_dir``, fp32, CPU, eval."""
    from tests.upstream import load_yaml_sections
    from tests.upstream3 import upstream3

    model_mod = upstream3("cosyvoice.cli.model")  # also puts the checkout first on sys.path
    yaml_text = (model_dir / "cosyvoice3.yaml").read_text()
    # The yaml's CFM reseeds the global RNGs while it is built; keep ours untouched.
    with torch.random.fork_rng():
        parts = load_yaml_sections(yaml_text, ("llm", "flow", "hift"), model_dir / "CosyVoice-BlankEN")
    parts["llm"].float()  # transformers 5 builds the Qwen2 body in config.json's bfloat16
    model = model_mod.CosyVoice3Model(parts["llm"], parts["flow"], parts["hift"])
    model.load(model_dir / "llm.pt", model_dir / "flow.pt", model_dir / "hift.pt")  # all strict
    assert str(type(model.llm).__module__).startswith("cosyvoice.llm"), type(model.llm)
    return model


def run_upstream(model: Any, spec: GenerationSpec) -> dict[str, Any]:
    """Upstream's ``tts`` on ``spec`` with its random draws made ours (see the docstring)."""
    assert spec.min_tokens == spec.max_tokens is not None
    tokens = spec.max_tokens
    (segment,) = spec.segments
    llm, hift = model.llm, model.hift
    sampler = UniformMultinomial(
        generators_for(spec.seed)[0], vocab=len(llm.stop_token_ids) + llm.speech_token_size
    )
    lm_tokens: list[int] = []
    calls: list[tuple[int, int, bool]] = []
    flow_tokens: list[list[int]] = []
    token2wav = model.token2wav

    def recording_token2wav(**kwargs: Any) -> Any:
        calls.append((int(kwargs["token"].shape[1]), int(kwargs["token_offset"]), bool(kwargs["finalize"])))
        flow_tokens.append(kwargs["token"][0].tolist())
        return token2wav(**kwargs)

    mels: list[torch.Tensor] = []
    flow_inference = model.flow.inference

    def recording_flow(**kwargs: Any) -> Any:
        mel, cache = flow_inference(**kwargs)
        mels.append(mel[0].clone())
        return mel, cache

    samples = (2 * tokens + 64) * hift.m_source.l_sin_gen.upsample_scale
    sines = hift.m_source.l_sin_gen.sine_waves.shape[2]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.Tensor, "multinomial", lambda t, n, replacement=False: sampler(t, n, replacement))
        patch.setattr(llm.llm, "forward_one_step", full_mask_step(llm.llm))
        forced_wrapper, masked_sampling_ids = forced_length(llm, tokens)
        patch.setattr(llm, "sampling_ids", masked_sampling_ids)
        patch.setattr(llm, "inference_wrapper", forced_wrapper)
        patch.setattr(llm, "inference_wrapper", recording_tokens(llm, lm_tokens))
        patch.setattr(
            hift.m_source.l_sin_gen,
            "sine_waves",
            noise_window(noise_seed(spec.seed), sines, 0, samples)[None],
        )
        patch.setattr(model, "token2wav", recording_token2wav)
        patch.setattr(model.flow, "inference", recording_flow)
        model.token_hop_len = 25  # upstream grows it on the model, across requests
        outputs: Iterator[dict[str, torch.Tensor]] = model.tts(
            text=torch.tensor([segment.text_ids]),
            flow_embedding=spec.embedding[None],
            llm_embedding=spec.embedding[None],
            prompt_text=torch.tensor([spec.lm_prefix_ids]),
            llm_prompt_speech_token=torch.tensor([spec.lm_prompt_speech]),
            flow_prompt_speech_token=spec.flow_prompt_tokens[None],
            prompt_speech_feat=spec.flow_prompt_mel[None],
            stream=spec.stream,
        )
        chunks = [out["tts_speech"][0].clone() for out in outputs]
    assert len(lm_tokens) == tokens, len(lm_tokens)
    # CosyVoice3Model.llm_job drops a silent token after 5 in a row; none here, so the
    # flow saw every LM token (our engine keeps them all).
    assert flow_tokens[-1] == lm_tokens, "upstream dropped silent tokens"
    audio = torch.cat(chunks)
    clipped = float((audio.abs() >= 0.99).float().mean())
    print(
        f"stream={spec.stream}: {tokens} tokens, calls {calls}, chunks {[c.numel() for c in chunks]}, "
        f"fallbacks {sampler.fallbacks}, clipped {clipped:.4f}, peak {float(audio.abs().max()):.3f}"
    )
    recorded: dict[str, Any] = {} if spec.stream else {"mel": mels[-1]}  # (80, 2N) the flow's
    return recorded | {
        "tokens": torch.tensor(lm_tokens, dtype=torch.int32),
        "token2wav_calls": calls,  # (tokens seen, token_offset, finalize) per call
        "chunks": chunks,
        "fallbacks": sampler.fallbacks,
    }


def inputs_of(spec: GenerationSpec) -> dict[str, Any]:
    (segment,) = spec.segments
    return {
        "seed": spec.seed,
        "token_count": spec.max_tokens,
        "stream": spec.stream,
        "text_ids": torch.tensor(segment.text_ids, dtype=torch.int64),
        "lm_prefix_ids": torch.tensor(spec.lm_prefix_ids, dtype=torch.int64),
        "lm_prompt_speech": torch.tensor(spec.lm_prompt_speech, dtype=torch.int64),
        "noise_seed": noise_seed(spec.seed),
    }


def make() -> dict[str, Any]:
    from tests.upstream3 import UPSTREAM_COMMIT

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model_dir(Path(tmp) / "tiny3")
        specs = {
            "non_streaming": our_spec(model_dir, SEED, TOKENS, stream=False),
            "streaming": our_spec(model_dir, STREAM_SEED, STREAM_TOKENS, stream=True),
        }
        voice = specs["streaming"]
        assert ENDOFPROMPT_ID in voice.lm_prefix_ids
        model = build_upstream_model(model_dir)
        fixture: dict[str, Any] = {
            "upstream_commit": UPSTREAM_COMMIT,
            "model_seed": MODEL_SEED,
            "manifest": (model_dir / MANIFEST_FILE).read_text(),
            "text": TEXT,
            # Our voice prompt (the same for both requests).
            "flow_prompt_tokens": voice.flow_prompt_tokens.clone(),
            "flow_prompt_mel": voice.flow_prompt_mel.clone(),
            "embedding": voice.embedding.clone(),
        }
        for name, spec in specs.items():
            assert torch.equal(spec.flow_prompt_tokens, voice.flow_prompt_tokens)
            fixture[name] = inputs_of(spec) | run_upstream(model, spec)
    return fixture


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n", 1)[0]).parse_args()
    fixture = make()
    FIXTURE.parent.mkdir(exist_ok=True)
    torch.save(fixture, FIXTURE)
    print(f"wrote {FIXTURE} ({FIXTURE.stat().st_size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
