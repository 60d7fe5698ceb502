"""The engine's flow prompt cache: streams start from their voice's primed prompt, with
the same audio as without it, and a voice is primed once."""

import numpy as np
import pytest
import torch

from cosyserve.bench.engine_runs import run_together
from cosyserve.bench.workload import synthetic_voice
from cosyserve.engine.config import EngineConfig, FlowCacheMode
from cosyserve.engine.engine import Engine
from cosyserve.engine.loader import LoadedModel
from cosyserve.engine.request import GenerationSpec
from cosyserve.models.flow.stream_cache import FlowStreamCache
from tests.engine.helpers import assert_same, voice_plan_specs


def _engine(model: LoadedModel, mode: FlowCacheMode, megabytes: int, whole: bool = False) -> Engine:
    config = EngineConfig(
        max_active=1, flow_cache=mode, flow_prompt_cache_mb=megabytes, flow_prompt_whole=whole
    )
    return Engine(model.lm, model.flow, model.hift, config)


def _specs(model: LoadedModel) -> list[GenerationSpec]:
    """Two streams of one voice (55 prompt tokens: 50 voice-only), one of another (31:
    25), one with too short a prompt to prime (27), and a non-streaming request."""
    voices = [
        synthetic_voice(model.hparams, seconds, seed=70 + i) for i, seconds in enumerate((2.2, 1.24, 1.08))
    ]
    plan = [(0, 5, True), (0, None, True), (1, 9, True), (2, 4, True), (0, None, False)]
    return voice_plan_specs(model, voices, plan, seed=500)


@pytest.mark.parametrize("mode", ["cached", "incremental"])
def test_the_same_audio_with_and_without_the_prompt_cache(
    tiny_model: LoadedModel, mode: FlowCacheMode
) -> None:
    specs = _specs(tiny_model)
    ids = [spec.request_id for spec in specs]
    off = _engine(tiny_model, mode, 0)
    assert off.flow_prompt_cache is None
    want = run_together(off, specs)
    on = _engine(tiny_model, mode, 64)
    got = run_together(on, specs)
    assert_same(got, want, ids)
    cache = on.flow_prompt_cache
    assert cache is not None
    # Voices 0 and 1 primed once each; the second stream of voice 0 is a hit.
    assert (cache.stats.misses, cache.stats.hits, len(cache)) == (2, 1, 2)


def test_whole_prompt_priming_changes_only_streams_whose_prompt_block_looks_past_the_prompt(
    tiny_model: LoadedModel,
) -> None:
    specs = _specs(tiny_model)
    want = run_together(_engine(tiny_model, "incremental", 64), specs)
    engine = _engine(tiny_model, "incremental", 64, whole=True)
    got = run_together(engine, specs)
    # Voices 0 and 1 (55 and 31 prompt tokens) have their look-ahead inside the prompt:
    # the same prefix either way. Voice 2 (27 tokens) now has its first block primed, its
    # look-ahead past the prompt read as zeros: the same tokens, slightly different audio.
    assert_same(got, want, ["req-0", "req-1", "req-2", "req-4"])
    changed, reference = got["req-3"], want["req-3"]
    assert changed.tokens == reference.tokens and changed.audio.shape == reference.audio.shape
    difference = float(np.abs(changed.audio - reference.audio).max())
    assert 1e-4 < difference < float(np.abs(reference.audio).max())
    cache = engine.flow_prompt_cache
    assert cache is not None and cache.whole
    assert (cache.stats.misses, cache.stats.hits, len(cache)) == (3, 1, 3)


@pytest.mark.parametrize("settings", [{"flow_cache": "exact"}, {"flow_prompt_cache_mb": 0}])
def test_whole_prompt_priming_without_a_prompt_cache_is_refused(settings: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="flow_prompt_whole needs the flow prompt cache"):
        EngineConfig(flow_prompt_whole=True, **settings)  # type: ignore[arg-type]


def test_exact_mode_has_no_prompt_cache(tiny_model: LoadedModel) -> None:
    engine = _engine(tiny_model, "exact", 64)
    assert engine.flow_prompt_cache is None


def test_a_priming_failure_fails_only_its_request(
    tiny_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    specs = _specs(tiny_model)
    engine = _engine(tiny_model, "incremental", 64)
    cache = engine.flow_prompt_cache
    assert cache is not None
    prime = cache.stream_cache
    failing = specs[2].flow_prompt_tokens  # voice 1: only request 2 uses it

    def stream_cache(prompt_token: torch.Tensor, *args: torch.Tensor) -> FlowStreamCache:
        if prompt_token is failing:
            raise RuntimeError("priming broke")
        return prime(prompt_token, *args)

    monkeypatch.setattr(cache, "stream_cache", stream_cache)
    results = run_together(engine, specs)
    assert results["req-2"].error is not None and results["req-2"].error.code == "internal_error"
    assert all(results[s.request_id].error is None for s in specs if s.request_id != "req-2")
    assert not engine.has_work()
