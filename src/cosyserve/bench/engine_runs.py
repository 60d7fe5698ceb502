"""Requests run through an :class:`Engine` step by step, without the async front, and what
each produced: for the tests that compare requests run alone and together."""

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cosyserve.bench.workload import synthetic_spec, synthetic_text_ids, synthetic_voice
from cosyserve.engine.config import EngineConfig
from cosyserve.engine.engine import Engine
from cosyserve.engine.loader import LoadedModel
from cosyserve.engine.request import GenerationSpec, StepOutput
from cosyserve.errors import CosyserveError
from cosyserve.pipeline.voice import VoicePrompt


@dataclass
class RequestResult:
    """What one request produced: its audio chunks, speech tokens, error and whether it
    finished."""

    chunks: list[np.ndarray] = field(default_factory=list)
    tokens: tuple[int, ...] | None = None
    error: CosyserveError | None = None
    finished: bool = False

    @property
    def audio(self) -> np.ndarray:
        return np.concatenate(self.chunks) if self.chunks else np.zeros(0, dtype=np.float32)


Results = dict[str, RequestResult]


def make_engine(model: LoadedModel, **options: Any) -> Engine:
    """An engine on ``model`` with :class:`EngineConfig` ``options``; its KV cache in the
    model's cache dtype unless ``dtype`` is given."""
    options.setdefault("dtype", model.precision.kv_cache_dtype)
    return Engine(model.lm, model.flow, model.hift, EngineConfig(**options))


def collect(outputs: list[StepOutput], results: Results) -> None:
    """Add one step's ``outputs`` to ``results`` (by request id)."""
    for out in outputs:
        result = results.setdefault(out.request_id, RequestResult())
        if result.finished:
            raise RuntimeError(f"output after the end of {out.request_id}")
        if out.audio is not None and out.audio.size:
            result.chunks.append(out.audio)
        result.error = out.error
        result.tokens = out.speech_tokens
        result.finished = out.finished


def drain(engine: Engine, results: Results, max_steps: int = 10_000) -> int:
    """Step until the engine is idle, collecting into ``results``; returns the steps taken.
    Raises RuntimeError after ``max_steps``."""
    steps = 0
    while engine.has_work():
        collect(engine.step(), results)
        steps += 1
        if steps >= max_steps:
            raise RuntimeError(f"the engine did not finish in {max_steps} steps")
    return steps


def run_together(engine: Engine, specs: list[GenerationSpec]) -> Results:
    """``specs`` added at once, run until the engine is idle."""
    results: Results = {}
    for spec in specs:
        engine.add(spec)
    drain(engine, results)
    return results


def run_alone(model: LoadedModel, specs: list[GenerationSpec], **options: Any) -> Results:
    """Each spec alone in an engine of one slot without prefix cache, its decode steps
    eager (unless ``options``, other :class:`EngineConfig` fields, say otherwise): the
    reference that requests run together are held to."""
    results: Results = {}
    reference: dict[str, Any] = {"max_active": 1, "prefix_cache_positions": 0, "traced_decode": False}
    engine = make_engine(model, **(reference | options))
    for spec in specs:
        engine.add(spec)
        drain(engine, results)
    return results


def voices(model: LoadedModel, count: int = 3) -> list[VoicePrompt]:
    """Voices with prompts of 1, 1.25, 1.5 ... seconds (4, 5, 6 ... prompt text ids)."""
    return [synthetic_voice(model.hparams, 1.0 + 0.25 * i, seed=i) for i in range(count)]


def mixed_specs(model: LoadedModel, count: int = 16) -> list[GenerationSpec]:
    """Streaming and not, three voices, their own seeds and forced lengths (12, 14, ...
    tokens; every fourth a stream with a short first hop, so that streams have several
    chunks)."""
    vs = voices(model)
    specs = []
    for i in range(count):
        tokens = 12 + 2 * i
        specs.append(
            synthetic_spec(
                f"req-{i}",
                vs[i % len(vs)],
                synthetic_text_ids(model.hparams, tokens, seed=i),
                tokens=tokens,
                seed=1000 + i,
                stream=i % 2 == 0,
                first_hop=8 if i % 4 == 0 else None,
            )
        )
    return specs
