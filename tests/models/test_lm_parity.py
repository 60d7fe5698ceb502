"""Parity of the native LM with upstream's ``Qwen2LM``, both loaded from the same llm.pt.

Upstream is built from our rendered ``cosyvoice2.yaml`` (hyperpyyaml, as upstream loads
it) over a ``CosyVoice-BlankEN`` directory written here; its Qwen2 weights are then
replaced by the strict load of the llm.pt we generate.
"""

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import save_file

from cosyserve.modeldir.hparams import ModelHParams
from cosyserve.modeldir.presets import FULL, TINY
from cosyserve.modeldir.yamlwrite import render_yaml
from cosyserve.models.kv_cache import KVCache
from cosyserve.models.lm import CosyVoice2LM, lm_checkpoint_table
from cosyserve.models.sampling import UNIFORMS_PER_STEP, LengthLimits, sample_token
from cosyserve.weights.checkpoint import load_checkpoint, to_checkpoint
from cosyserve.weights.randomize import randomize_
from tests.upstream import load_yaml_sections

# Upstream passes transformers 5 the deprecated ``past_key_values`` argument.
pytestmark = [pytest.mark.parity, pytest.mark.filterwarnings("ignore:.*past_key_values:FutureWarning")]

TOL = 1e-4
# A sharper speech head than randomize_'s unit-scale logits, so that generation meets the
# top-p crossing and, with a few favoured ids, repeats itself into the RAS fallback
# instead of always keeping 25 near-equal tokens.
HEAD_GAIN = 6.0
FAVOURED_IDS, FAVOUR = 8, 10.0


@dataclass
class Pair:
    ours: CosyVoice2LM
    theirs: Any  # upstream cosyvoice.llm.llm.Qwen2LM
    llm_pt: Path


def _write_blank_en(path: Path, hp: ModelHParams, state: dict[str, torch.Tensor]) -> None:
    """A CosyVoice-BlankEN dir for ``Qwen2ForCausalLM.from_pretrained``: config.json and a
    model.safetensors holding llm.pt's backbone (overwritten by llm.pt anyway)."""
    q = hp.lm.qwen
    transformers.Qwen2Config(
        vocab_size=q.vocab_size,
        hidden_size=q.hidden_size,
        intermediate_size=q.intermediate_size,
        num_hidden_layers=q.num_hidden_layers,
        num_attention_heads=q.num_attention_heads,
        num_key_value_heads=q.num_key_value_heads,
        rms_norm_eps=q.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": q.rope_theta},
        max_position_embeddings=q.max_position_embeddings,
        tie_word_embeddings=q.tie_word_embeddings,
    ).save_pretrained(path)
    prefix = "llm.model."
    backbone = {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
    del backbone["lm_head.weight"]  # tied: safetensors refuses a shared tensor
    save_file(backbone, path / "model.safetensors", metadata={"format": "pt"})


def build_pair(hp: ModelHParams, root: Path, seed: int) -> Pair:
    """Generate llm.pt as ``cosyserve model init`` does, load it into both models."""
    generated = CosyVoice2LM(hp.lm)
    randomize_(generated, torch.Generator().manual_seed(seed))
    with torch.no_grad():
        generated.llm_decoder.weight.mul_(HEAD_GAIN)
        generated.llm_decoder.bias[:FAVOURED_IDS] += FAVOUR
    state = to_checkpoint(generated, lm_checkpoint_table(hp.lm))
    llm_pt = root / "llm.pt"
    torch.save(state, llm_pt)
    _write_blank_en(root / "CosyVoice-BlankEN", hp, state)
    del generated, state
    theirs = load_yaml_sections(render_yaml(hp), ("llm",), root / "CosyVoice-BlankEN")["llm"]
    theirs.load_state_dict(torch.load(llm_pt, weights_only=True), strict=True)
    ours = CosyVoice2LM(hp.lm)
    load_checkpoint(ours, llm_pt, lm_checkpoint_table(hp.lm))
    return Pair(ours.eval(), theirs.eval(), llm_pt)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Pair:
    return build_pair(TINY, tmp_path_factory.mktemp("lm"), seed=11)


def _ids(seed: int, n_text: int, n_speech: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    text = torch.randint(0, TINY.lm.qwen.vocab_size, (n_text,), generator=gen)
    return text, torch.randint(0, TINY.lm.speech_token_size, (n_speech,), generator=gen)


def _full_mask_step(encoder: Any) -> Callable[..., Any]:
    """Upstream's ``forward_one_step`` with an all-ones attention mask over cache + new
    positions. Upstream passes a (1, 1) mask on decode steps, which transformers 4.51 (its
    supported version) ignores as all-ones but transformers 5 misreads; the all-ones mask
    is what upstream means."""
    original = encoder.forward_one_step

    def step(xs: torch.Tensor, masks: torch.Tensor, cache: Any = None) -> Any:
        past = 0 if cache is None else cache.get_seq_length()
        return original(xs, torch.ones(1, 1, past + xs.shape[1], dtype=torch.bool), cache)

    return step


def test_generated_llm_pt_has_exactly_upstreams_keys_and_shapes(pair: Pair) -> None:
    written = torch.load(pair.llm_pt, weights_only=True)
    expected = pair.theirs.state_dict()
    assert set(written) == set(expected)
    assert {k: tuple(v.shape) for k, v in written.items()} == {k: tuple(v.shape) for k, v in expected.items()}


@torch.no_grad()
def test_prompt_layout_matches_upstream(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    captured: list[torch.Tensor] = []

    def capture(lm_input: torch.Tensor, *_: Any) -> Iterator[int]:
        captured.append(lm_input)
        return iter(())

    monkeypatch.setattr(pair.theirs, "inference_wrapper", capture)
    prompt_text, _ = _ids(1, 4, 0)
    text, speech = _ids(2, 6, 5)
    list(
        pair.theirs.inference(
            text[None], torch.tensor([6]), prompt_text[None], torch.tensor([4]),
            speech[None], torch.tensor([5]), torch.zeros(1, 192),
        )
    )  # fmt: skip
    ours = pair.ours.prompt_embeddings(torch.cat([prompt_text, text]), speech)
    assert torch.equal(captured[0][0], ours)


@torch.no_grad()
def test_teacher_forced_hidden_states_and_logits_match(pair: Pair) -> None:
    text, speech = _ids(3, 12, 6)
    generated = torch.tensor([4, 4000, 6560, 12, 999])
    emb = torch.cat([pair.ours.prompt_embeddings(text, speech), pair.ours.speech_embedding(generated)])[None]
    hidden, logits = pair.ours.teacher_forced(emb)
    their_hidden, _ = pair.theirs.llm(emb, torch.tensor([emb.shape[1]]))
    assert (hidden - their_hidden).abs().max() <= TOL
    assert (logits - pair.theirs.llm_decoder(their_hidden)).abs().max() <= TOL


@torch.no_grad()
def test_prefill_then_decode_matches_upstream_forward_one_step(pair: Pair) -> None:
    text, speech = _ids(4, 9, 7)
    prompt = pair.ours.prompt_embeddings(text, speech)
    cache = KVCache.for_config(TINY.lm.qwen, 2, 64)
    slot = cache.allocate()
    step = _full_mask_step(pair.theirs.llm)
    ours = pair.ours.prefill(prompt, slot, cache)
    y, their_cache = step(prompt[None], None, None)
    for token in [17, 17, 6000, 3, 250, 4096]:
        theirs = pair.theirs.llm_decoder(y[:, -1]).log_softmax(-1)[0]
        assert (ours - theirs).abs().max() <= TOL
        ours = pair.ours.decode(torch.tensor([token]), [slot], cache)[0]
        y, their_cache = step(pair.theirs.speech_embedding.weight[token].reshape(1, 1, -1), None, their_cache)


@torch.no_grad()
def test_batched_decode_matches_upstream_full_forward(pair: Pair) -> None:
    cache = KVCache.for_config(TINY.lm.qwen, 4, 64)
    slots = [cache.allocate() for _ in range(4)][1:]  # slots 1..3
    sizes = [(2, 0), (14, 9), (7, 3)]  # (text, prompt speech) tokens
    prompts = [pair.ours.prompt_embeddings(*_ids(10 + i, n, m)) for i, (n, m) in enumerate(sizes)]
    for slot, prompt in zip(slots, prompts, strict=True):
        pair.ours.prefill(prompt, slot, cache)
    steps = torch.tensor([[1, 2, 3], [6000, 6001, 6002], [5, 5, 5]])
    for row in steps:
        got = pair.ours.decode(row, slots, cache)
    for i, prompt in enumerate(prompts):
        emb = torch.cat([prompt, pair.theirs.speech_embedding(steps[:, i])])[None]
        their_hidden, _ = pair.theirs.llm(emb, torch.tensor([emb.shape[1]]))
        theirs = pair.theirs.llm_decoder(their_hidden[0, -1]).log_softmax(-1)
        assert (got[i] - theirs).abs().max() <= TOL


@dataclass
class StepUniforms:
    """Upstream's multinomial fed with our sampler's uniform stream: each step draws a
    pair; the nucleus call takes the first, a fallback (full-vocabulary) call the second."""

    generator: torch.Generator
    vocab: int
    pair: list[float] = field(default_factory=list)
    fallbacks: int = 0
    narrowed: int = 0  # nucleus draws where top_p, not top_k, bounded the kept tokens

    def __call__(self, weights: torch.Tensor, num_samples: int, replacement: bool = False) -> torch.Tensor:
        if weights.numel() == self.vocab:
            u, self.fallbacks = self.pair[1], self.fallbacks + 1
        else:
            self.pair = torch.rand(UNIFORMS_PER_STEP, generator=self.generator, dtype=torch.float64).tolist()
            u = self.pair[0]
            self.narrowed += weights.numel() < 25
        cum = weights.double().cumsum(0)
        index = min(int((cum <= u * cum[-1]).sum()), int(torch.nonzero(weights > 0).max()))
        return torch.tensor([index])


def test_generation_matches_upstream_inference(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompt, prefill, decode loop, sampler and history against upstream ``inference``
    (its non-vLLM loop). No minimum length: below it upstream's installed version
    re-draws eos instead of masking it (see sampling.py)."""
    seed, n_text = 5, 4
    cfg = dataclasses.replace(TINY.lm, min_token_text_ratio=0.0, max_token_text_ratio=8.0)
    prompt_text, _ = _ids(20, 3, 0)
    text, speech = _ids(21, n_text, 6)
    fake = StepUniforms(torch.Generator().manual_seed(seed), pair.ours.num_speech_ids)
    monkeypatch.setattr(torch.Tensor, "multinomial", lambda t, n, replacement=False: fake(t, n, replacement))
    monkeypatch.setattr(pair.theirs.llm, "forward_one_step", _full_mask_step(pair.theirs.llm))
    theirs = list(
        pair.theirs.inference(
            text[None], torch.tensor([n_text]), prompt_text[None], torch.tensor([3]),
            speech[None], torch.tensor([6]), torch.zeros(1, 192),
            max_token_text_ratio=cfg.max_token_text_ratio, min_token_text_ratio=cfg.min_token_text_ratio,
        )
    )  # fmt: skip

    limits = LengthLimits.for_text(n_text, cfg)
    gen = torch.Generator().manual_seed(seed)
    cache = KVCache.for_config(cfg.qwen, 1, 64)
    slot = cache.allocate()
    ours: list[int] = []
    with torch.no_grad():
        prompt = pair.ours.prompt_embeddings(torch.cat([prompt_text, text]), speech)
        log_probs = pair.ours.prefill(prompt, slot, cache)
        while len(ours) < limits.max_tokens:
            token = sample_token(log_probs, ours, gen, limits, cfg.sampling)
            if token in limits.stop_ids:
                break
            ours.append(token)
            log_probs = pair.ours.decode(torch.tensor([token]), [slot], cache)[0]
    assert ours == theirs
    assert len(ours) == limits.max_tokens == 32
    # The loop went through the top-p crossing and the repetition fallback.
    assert fake.narrowed >= 10
    assert fake.fallbacks >= 1


@pytest.mark.slow
@torch.no_grad()
def test_full_geometry_single_step_parity(tmp_path: Path) -> None:
    full = build_pair(FULL, tmp_path, seed=3)
    text, speech = _ids(30, 10, 8)
    prompt = full.ours.prompt_embeddings(text, speech)
    cache = KVCache.for_config(FULL.lm.qwen, 1, 32)
    slot = cache.allocate()
    step = _full_mask_step(full.theirs.llm)
    ours = full.ours.prefill(prompt, slot, cache)
    y, their_cache = step(prompt[None], None, None)
    assert (ours - full.theirs.llm_decoder(y[:, -1]).log_softmax(-1)[0]).abs().max() <= TOL
    ours = full.ours.decode(torch.tensor([1234]), [slot], cache)[0]
    y, _ = step(full.theirs.speech_embedding.weight[1234].reshape(1, 1, -1), None, their_cache)
    assert (ours - full.theirs.llm_decoder(y[:, -1]).log_softmax(-1)[0]).abs().max() <= TOL
