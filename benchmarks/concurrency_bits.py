"""Issue 4's concurrency promise on a full-size model: requests run together get the speech
tokens they get alone, and audio within 1e-4 of it.

    python benchmarks/concurrency_bits.py --model-dir /tmp/cv2-full-bench [--dtype bf16]
        [--quantize int8] [--requests 8] [--json out.json]

The tests check this on the tiny model (``tests/engine/test_concurrency.py``); a full-size
model has the released head geometry and longer spans, where torch's CPU attention kernel
gave a lone decode row other bits than a batch on a Zen 4 (docs/benchmarks.md, "Run 66").
``--requests`` requests as the tests build them (streaming and not, three voices, their own
seeds, 12 to 26 forced tokens, some streams with a short first hop) run one at a time in an
engine of one slot with eager decode steps, then all at once in an engine with the default
settings. For each request the script prints whether its tokens are the same, where they
first differ, and the largest audio difference where they are.
"""

import json
from typing import Any

import numpy as np
from bench_args import model_parser  # benchmarks/ is on the path when run as a script

from cosyserve.bench.workload import synthetic_spec, synthetic_text_ids, synthetic_voice
from cosyserve.engine.config import EngineConfig
from cosyserve.engine.engine import Engine
from cosyserve.engine.request import GenerationSpec
from cosyserve.loader import LoadedModel, load_model

Outputs = dict[str, tuple[tuple[int, ...], np.ndarray]]


def main() -> None:
    parser = model_parser(__doc__)
    parser.add_argument("--requests", type=int, default=8)
    args = parser.parse_args()
    model = load_model(args.model_dir, dtype=args.dtype, quantize=args.quantize)
    specs = _specs(model, args.requests)
    dtype = model.precision.kv_cache_dtype
    alone: Outputs = {}
    reference = EngineConfig(max_active=1, prefix_cache_positions=0, traced_decode=False, dtype=dtype)
    single = _engine(model, reference)
    for spec in specs:
        alone |= _run(single, [spec])
    together = _run(_engine(model, EngineConfig(max_active=max(16, len(specs)), dtype=dtype)), specs)
    rows = [_compare(spec.request_id, alone, together) for spec in specs]
    report = {
        "precision": model.precision.describe(),
        "same_tokens": sum(row["same_tokens"] for row in rows),
        "requests": rows,
    }
    print(json.dumps(report, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))


def _specs(model: LoadedModel, count: int) -> list[GenerationSpec]:
    voices = [synthetic_voice(model.hparams, 1.0 + 0.25 * i, seed=i) for i in range(3)]
    return [
        synthetic_spec(
            f"req-{i}",
            voices[i % len(voices)],
            synthetic_text_ids(model.hparams, 12 + 2 * i, seed=i),
            tokens=12 + 2 * i,
            seed=1000 + i,
            stream=i % 2 == 0,
            first_hop=8 if i % 4 == 0 else None,
        )
        for i in range(count)
    ]


def _engine(model: LoadedModel, config: EngineConfig) -> Engine:
    return Engine(model.lm, model.flow, model.hift, config)


def _run(engine: Engine, specs: list[GenerationSpec]) -> Outputs:
    """Each request's speech tokens and audio, the requests added at once."""
    chunks: dict[str, list[np.ndarray]] = {spec.request_id: [] for spec in specs}
    tokens: dict[str, tuple[int, ...]] = {}
    for spec in specs:
        engine.add(spec)
    while engine.has_work():
        for out in engine.step():
            if out.error is not None:
                raise RuntimeError(f"{out.request_id} failed: {out.error}")
            if out.audio is not None and out.audio.size:
                chunks[out.request_id].append(out.audio)
            if out.speech_tokens is not None:
                tokens[out.request_id] = out.speech_tokens
    return {rid: (tokens[rid], np.concatenate(parts)) for rid, parts in chunks.items()}


def _compare(request_id: str, alone: Outputs, together: Outputs) -> dict[str, Any]:
    (want, want_audio), (got, got_audio) = alone[request_id], together[request_id]
    row: dict[str, Any] = {"request": request_id, "tokens": len(want), "same_tokens": got == want}
    if got != want:
        pairs = enumerate(zip(got, want, strict=False))
        row["first_difference"] = next((i for i, (a, b) in pairs if a != b), min(len(got), len(want)))
    elif got_audio.shape == want_audio.shape:
        row["max_audio_difference"] = float(np.abs(got_audio - want_audio).max())
    return row


if __name__ == "__main__":
    main()
