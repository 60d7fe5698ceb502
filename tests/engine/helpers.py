"""The tests' check on requests run alone and together (the runs: cosyserve.bench.engine_runs)."""

import numpy as np

from cosyserve.bench.engine_runs import Results
from cosyserve.bench.workload import synthetic_spec, synthetic_text_ids
from cosyserve.engine.loader import LoadedModel
from cosyserve.engine.request import GenerationSpec
from cosyserve.pipeline.voice import VoicePrompt


def assert_same(results: Results, reference: Results, ids: list[str]) -> None:
    for request_id in ids:
        got, want = results[request_id], reference[request_id]
        assert got.error is None and want.error is None, (request_id, got.error, want.error)
        assert got.finished and want.finished
        assert got.tokens is not None and len(got.tokens) > 0
        assert got.tokens == want.tokens, request_id
        assert got.audio.shape == want.audio.shape, request_id
        assert float(np.abs(got.audio - want.audio).max()) <= 1e-4, request_id


def voice_plan_specs(
    model: LoadedModel, voices: list[VoicePrompt], plan: list[tuple[int, int | None, bool]], seed: int
) -> list[GenerationSpec]:
    """Requests of 60, 63, ... forced tokens, one per ``(voice index, first hop, stream)``
    of ``plan``, seeded from ``seed``: the prompt-cache tests' workload."""
    return [
        synthetic_spec(
            f"req-{i}",
            voices[v],
            synthetic_text_ids(model.hparams, 60, seed=i),
            tokens=60 + 3 * i,
            seed=seed + i,
            stream=stream,
            first_hop=hop,
        )
        for i, (v, hop, stream) in enumerate(plan)
    ]
