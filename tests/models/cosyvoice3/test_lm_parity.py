"""Parity of :class:`CosyVoice3LM` with upstream's ``CosyVoice3LM`` (commit ace7c47) through
committed fixtures (``make_lm_fixtures.py``): our module is rebuilt from the same preset and
seed, its ``llm.pt`` checked against upstream's state-dict keys and shapes, and its prompt
layout, prefill and decode log-probs compared with upstream's ``inference`` loop."""

from pathlib import Path
from typing import Any

import pytest
import torch

from cosyserve.modeldir.hparams3 import Model3HParams
from cosyserve.modeldir.presets import FULL3, TINY3
from cosyserve.models.kv_cache import KVCache
from cosyserve.models.lm3 import CosyVoice3LM, lm3_checkpoint_table
from cosyserve.models.sampling import LengthLimits
from cosyserve.weights.checkpoint import load_checkpoint, to_checkpoint
from cosyserve.weights.randomize import randomize_

pytestmark = pytest.mark.parity

FIXTURES = Path(__file__).parent / "fixtures"
TOL = 1e-4


def _fixture(name: str) -> dict[str, Any]:
    fixture: dict[str, Any] = torch.load(FIXTURES / f"lm-{name}.pt", weights_only=True)
    return fixture


def _ours(hp: Model3HParams, seed: int, tmp_path: Path) -> CosyVoice3LM:
    """Our LM as the maker built it, written to llm.pt and read back through the table."""
    generated = CosyVoice3LM(hp.lm)
    randomize_(generated, torch.Generator().manual_seed(seed))
    llm_pt = tmp_path / "llm.pt"
    torch.save(to_checkpoint(generated, lm3_checkpoint_table(hp.lm)), llm_pt)
    del generated
    model = CosyVoice3LM(hp.lm)
    load_checkpoint(model, llm_pt, lm3_checkpoint_table(hp.lm))
    return model.eval()


@pytest.fixture(scope="module")
def tiny() -> dict[str, Any]:
    return _fixture("tiny")


@pytest.fixture(scope="module")
def tiny_lm(tiny: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> CosyVoice3LM:
    return _ours(TINY3, tiny["seed"], tmp_path_factory.mktemp("lm3"))


def _check_checkpoint_keys(hp: Model3HParams, model: CosyVoice3LM, fixture: dict[str, Any]) -> None:
    written = to_checkpoint(model, lm3_checkpoint_table(hp.lm))
    assert {k: tuple(v.shape) for k, v in written.items()} == fixture["upstream_shapes"]


@torch.no_grad()
def _check_log_probs(hp: Model3HParams, model: CosyVoice3LM, fixture: dict[str, Any]) -> list[float]:
    """Prefill, then the forced decode steps, against upstream's rows; returns the max diffs."""
    prompt = model.prompt_embeddings(
        torch.cat([fixture["prompt_text"], fixture["text"]]), fixture["prompt_speech"]
    )
    assert (prompt - fixture["prompt_embeddings"]).abs().max() == 0
    expected = fixture["log_probs"]  # (1 + steps, V)
    cache = KVCache.for_config(hp.lm.qwen, 1, 64)
    slot = cache.allocate()
    got = [model.prefill(prompt, slot, cache)]
    for token in fixture["forced"]:
        got.append(model.decode(token[None], [slot], cache)[0])
    diffs = [float((g - e).abs().max()) for g, e in zip(got, expected, strict=True)]
    assert max(diffs) <= TOL, diffs

    # The same rows from one teacher-forced pass over the whole sequence.
    emb = torch.cat([prompt, model.speech_embedding(fixture["forced"])])[None]
    _, logits = model.teacher_forced(emb)
    rows = logits[0, prompt.shape[0] - 1 :].float().log_softmax(-1)
    assert (rows - expected).abs().max() <= TOL
    return diffs


def test_llm_pt_has_exactly_upstreams_keys_and_shapes(tiny: dict[str, Any], tiny_lm: CosyVoice3LM) -> None:
    _check_checkpoint_keys(TINY3, tiny_lm, tiny)
    # No llm_embedding and a bias-free head of 6561 + 200 rows.
    assert tiny["upstream_shapes"]["llm_decoder.weight"] == (6761, TINY3.lm.qwen.hidden_size)
    assert "llm_decoder.bias" not in tiny["upstream_shapes"]
    assert not any(k.startswith("llm_embedding") for k in tiny["upstream_shapes"])


def test_prefill_and_decode_log_probs_match_upstream(tiny: dict[str, Any], tiny_lm: CosyVoice3LM) -> None:
    assert tiny["log_probs"].shape == (len(tiny["forced"]) + 1, TINY3.lm.num_speech_ids)
    _check_log_probs(TINY3, tiny_lm, tiny)


def test_stop_ids_and_min_length_mask_match_upstream(tiny: dict[str, Any]) -> None:
    cfg = TINY3.lm
    assert cfg.stop_token_ids == tuple(tiny["stop_token_ids"].tolist())
    # Upstream's sampling_ids(ignore_eos=True) masks index speech_token_size, sos in CosyVoice 3.
    assert cfg.ids_masked_below_min_len == tuple(tiny["masked_below_min_len"].tolist()) == (cfg.sos,)
    limits = LengthLimits.for_text(5, cfg)
    assert (limits.min_tokens, limits.max_tokens) == (10, 100)
    assert limits.masked_ids(9) == (6561,) and limits.masked_ids(10) == ()
    assert limits.stop_ids == tuple(range(6561, 6761))
    assert LengthLimits.forced(3, 3, cfg).masked_ids(0) == limits.stop_ids


@pytest.mark.slow
def test_full_geometry_log_probs_match_upstream(tmp_path: Path) -> None:
    full = _fixture("full")
    model = _ours(FULL3, full["seed"], tmp_path)
    _check_checkpoint_keys(FULL3, model, full)
    _check_log_probs(FULL3, model, full)
