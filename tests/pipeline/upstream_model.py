"""Upstream's whole ``CosyVoice2Model`` over one of our model directories, and the patches
that make its random parts comparable with ours (test-only; cosyserve never imports this).

Upstream draws everything from the global torch RNG (LM sampling in the LM thread, HiFT
noise in the caller's); we draw from per-request generators. The patches here feed
upstream the same numbers:

- LM sampling: ``torch.Tensor.multinomial`` becomes an inverse-CDF draw on our sampler's
  uniform stream (two float64 uniforms per step; the nucleus draw takes the first, the
  repetition fallback over the whole vocabulary the second).
- Forced length (upstream-cpu-baseline.md): ``inference_wrapper`` runs with
  ``min_len = max_len = N``, and below ``min_len`` all three stop ids are masked instead
  of re-drawing until eos is avoided.
- HiFT: before each of upstream's vocoder calls the global RNG takes the state our
  request's vocoder generator had before our call with the same index. Per-call replay is
  needed because upstream's source module draws one more normal per sample after the
  excitation (its unused noise branch), so its stream drifts from ours after one call.
- Qwen2 dtype: see :func:`build_upstream_model`.
- Decode attention mask: transformers 5 misreads upstream's (1, 1) decode mask; the step
  gets the all-ones mask upstream means (as tests/models/test_lm_parity.py does).
"""

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from cosyserve.models.hift.source import Excitation
from cosyserve.models.sampling import UNIFORMS_PER_STEP
from tests.upstream import load_yaml_sections, upstream


def build_upstream_model(model_dir: Path) -> Any:
    """``cosyvoice.cli.model.CosyVoice2Model`` with llm, flow and hift loaded strictly from
    ``model_dir``'s llm.pt, flow.pt and hift.pt (fp32, CPU, eval)."""
    yaml_text = (model_dir / "cosyvoice2.yaml").read_text()
    # Upstream's CFM reseeds the global RNGs while it is built; keep the caller's untouched.
    with torch.random.fork_rng():
        parts = load_yaml_sections(yaml_text, ("llm", "flow", "hift"), model_dir / "CosyVoice-BlankEN")
    model = upstream("cosyvoice.cli.model").CosyVoice2Model(parts["llm"], parts["flow"], parts["hift"])
    model.load(None, model_dir / "flow.pt", model_dir / "hift.pt")  # strict; llm.pt is not its job
    # transformers 5 builds the Qwen2 body in the config's bfloat16; upstream's pinned 4.51
    # built it in float32, which llm.pt (float32) must load into to keep every bit.
    llm = parts["llm"].float()
    llm.load_state_dict(torch.load(model_dir / "llm.pt", weights_only=True), strict=True)
    model.llm = llm.eval()  # this upstream version leaves CosyVoice2Model.llm unset
    return model


def full_mask_step(encoder: Any) -> Callable[..., Any]:
    """Upstream ``Qwen2Encoder.forward_one_step`` with an all-ones mask over cache + new."""
    original = encoder.forward_one_step

    def step(xs: torch.Tensor, masks: torch.Tensor, cache: Any = None) -> Any:
        past = 0 if cache is None else cache.get_seq_length()
        return original(xs, torch.ones(1, 1, past + xs.shape[1], dtype=torch.bool), cache)

    return step


@dataclass
class UniformMultinomial:
    """Stands in for ``torch.Tensor.multinomial`` in upstream's sampler: each nucleus call
    takes a fresh pair of uniforms from ``generator`` and uses the first; a fallback call
    (over all ``vocab`` ids) uses the second of the same pair."""

    generator: torch.Generator
    vocab: int
    pair: list[float] = field(default_factory=list)
    fallbacks: int = 0

    def __call__(self, weights: torch.Tensor, num_samples: int, replacement: bool = False) -> torch.Tensor:
        if weights.numel() == self.vocab:
            u = self.pair[1]
            self.fallbacks += 1
        else:
            self.pair = torch.rand(UNIFORMS_PER_STEP, generator=self.generator, dtype=torch.float64).tolist()
            u = self.pair[0]
        cum = weights.double().cumsum(0)
        index = min(int((cum <= u * cum[-1]).sum()), int(torch.nonzero(weights > 0).max()))
        return torch.tensor([index])


def forced_length(llm: Any, tokens: int) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """Replacements for ``llm.inference_wrapper`` and ``llm.sampling_ids`` that make
    upstream generate exactly ``tokens`` tokens."""
    wrapper, sampling_ids = llm.inference_wrapper, llm.sampling_ids
    stop_ids = list(llm.stop_token_ids)

    def forced_wrapper(lm_input: torch.Tensor, sampling: int, min_len: int, max_len: int, uuid: str) -> Any:
        return wrapper(lm_input, sampling, tokens, tokens, uuid)

    def masked_sampling_ids(
        scores: torch.Tensor, decoded: list[int], sampling: int, ignore_eos: bool = True
    ) -> Any:
        if ignore_eos:
            scores = scores.clone()
            scores[stop_ids] = float("-inf")
        return sampling_ids(scores, decoded, sampling, ignore_eos)

    return forced_wrapper, masked_sampling_ids


def record_excitation_states(monkeypatch: pytest.MonkeyPatch, states: list[torch.Tensor]) -> None:
    """Make our ``Excitation.draw`` append the request generator's state before each draw
    (one per vocoder call: the engine draws a chunk's excitation just before HiFT runs)."""
    original = Excitation.draw

    def draw(batch: int, sines: int, samples: int, generator: Any) -> Excitation:
        if isinstance(generator, torch.Generator):
            states.append(generator.get_state())
        return original(batch, sines, samples, generator)

    monkeypatch.setattr(Excitation, "draw", staticmethod(draw))


def replaying_global_states(hift: Any, states: list[torch.Tensor]) -> Callable[..., Any]:
    """Upstream's ``hift.inference``, setting the global RNG to ``states[i]`` before call i."""
    original = hift.inference
    replay: Iterator[torch.Tensor] = iter(states)

    def inference(*args: Any, **kwargs: Any) -> Any:
        torch.set_rng_state(next(replay))
        return original(*args, **kwargs)

    return inference


def recording_tokens(llm: Any, tokens: list[int]) -> Callable[..., Any]:
    """Upstream's (possibly already replaced) ``llm.inference_wrapper``, recording what it yields."""
    original = llm.inference_wrapper

    def wrapper(*args: Any, **kwargs: Any) -> Iterator[int]:
        for token in original(*args, **kwargs):
            tokens.append(int(token))
            yield token

    return wrapper
