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

from cosyserve.bench.engine_runs import Results, make_engine, mixed_specs, run_alone, run_together
from cosyserve.engine.loader import load_model


def main() -> None:
    parser = model_parser(__doc__)
    parser.add_argument("--requests", type=int, default=8)
    args = parser.parse_args()
    model = load_model(args.model_dir, dtype=args.dtype, quantize=args.quantize)
    specs = mixed_specs(model, args.requests)
    alone = run_alone(model, specs)
    together = run_together(make_engine(model, max_active=max(16, len(specs))), specs)
    for results in (alone, together):
        failed = {rid: result.error for rid, result in results.items() if result.error is not None}
        if failed:
            raise SystemExit(f"requests failed: {failed}")
    rows = [_compare(spec.request_id, alone, together) for spec in specs]
    report = {
        "precision": model.precision.describe(),
        "same_tokens": sum(row["same_tokens"] for row in rows),
        "requests": rows,
    }
    print(json.dumps(report, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))


def _compare(request_id: str, alone: Results, together: Results) -> dict[str, Any]:
    want, got = alone[request_id].tokens or (), together[request_id].tokens or ()
    want_audio, got_audio = alone[request_id].audio, together[request_id].audio
    row: dict[str, Any] = {"request": request_id, "tokens": len(want), "same_tokens": got == want}
    if got != want:
        pairs = enumerate(zip(got, want, strict=False))
        row["first_difference"] = next((i for i, (a, b) in pairs if a != b), min(len(got), len(want)))
    elif got_audio.shape == want_audio.shape:
        row["max_audio_difference"] = float(np.abs(got_audio - want_audio).max())
    return row


if __name__ == "__main__":
    main()
