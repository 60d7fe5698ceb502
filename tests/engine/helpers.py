"""Running specs through an engine and collecting what each request produced."""

from dataclasses import dataclass, field

import numpy as np

from cosyserve.bench.workload import synthetic_spec, synthetic_text_ids, synthetic_voice
from cosyserve.engine.config import EngineConfig
from cosyserve.engine.engine import Engine
from cosyserve.engine.request import GenerationSpec, StepOutput
from cosyserve.errors import CosyserveError
from cosyserve.loader import LoadedModel
from cosyserve.pipeline.voice import VoicePrompt


@dataclass
class Result:
    chunks: list[np.ndarray] = field(default_factory=list)
    tokens: tuple[int, ...] | None = None
    error: CosyserveError | None = None
    finished: bool = False

    @property
    def audio(self) -> np.ndarray:
        return np.concatenate(self.chunks) if self.chunks else np.zeros(0, dtype=np.float32)


def make_engine(model: LoadedModel, **options: int) -> Engine:
    return Engine(model.lm, model.flow, model.hift, EngineConfig(**options))


def drain(engine: Engine, results: dict[str, Result], max_steps: int = 10_000) -> int:
    """Step until the engine is idle; returns the steps taken."""
    steps = 0
    while engine.has_work():
        collect(engine.step(), results)
        steps += 1
        assert steps < max_steps, "the engine did not finish"
    return steps


def collect(outputs: list[StepOutput], results: dict[str, Result]) -> None:
    for out in outputs:
        result = results.setdefault(out.request_id, Result())
        assert not result.finished, f"output after the end of {out.request_id}"
        if out.audio is not None and out.audio.size:
            result.chunks.append(out.audio)
        result.error = out.error
        result.tokens = out.speech_tokens
        result.finished = out.finished


def run_together(engine: Engine, specs: list[GenerationSpec]) -> dict[str, Result]:
    results: dict[str, Result] = {}
    for spec in specs:
        engine.add(spec)
    drain(engine, results)
    return results


def run_alone(model: LoadedModel, specs: list[GenerationSpec]) -> dict[str, Result]:
    """Each spec alone in an engine of one slot without prefix cache, its decode steps
    eager: the reference."""
    results: dict[str, Result] = {}
    engine = make_engine(model, max_active=1, prefix_cache_positions=0, traced_decode=False)
    for spec in specs:
        engine.add(spec)
        drain(engine, results)
    return results


def voices(model: LoadedModel, count: int = 3) -> list[VoicePrompt]:
    """Voices with prompts of 1, 1.25, 1.5 ... seconds (4, 5, 6 ... prompt text ids)."""
    return [synthetic_voice(model.hparams, 1.0 + 0.25 * i, seed=i) for i in range(count)]


def mixed_specs(model: LoadedModel, count: int = 16) -> list[GenerationSpec]:
    """Streaming and not, three voices, own seeds and forced lengths (some with a short
    first hop, so that streams have several chunks)."""
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


def assert_same(results: dict[str, Result], reference: dict[str, Result], ids: list[str]) -> None:
    for request_id in ids:
        got, want = results[request_id], reference[request_id]
        assert got.error is None and want.error is None, (request_id, got.error, want.error)
        assert got.finished and want.finished
        assert got.tokens is not None and len(got.tokens) > 0
        assert got.tokens == want.tokens, request_id
        assert got.audio.shape == want.audio.shape, request_id
        assert float(np.abs(got.audio - want.audio).max()) <= 1e-4, request_id
