"""One stream's first audio and whole time through the engine, for two precision settings
loaded side by side in one process, the settings taking turns.

    python benchmarks/engine_ab.py --model-dir /tmp/cv2-full-bench \\
        --settings fp32+int8,fp32+int8+flow-fp16 --flow-prompt-whole --json out.json

Settings are written as for ``benchmarks/precision_quality.py`` (``DTYPE[+QUANT][+flow-fp16]``).
Separate processes on this shared VM differ by more than the gains measured here (upstream's
own non-streaming time moved from 42.8 to 55.0 s between two runs three hours apart), so each
of ``--turns`` turns runs ``cosyserve bench engine``'s level of one streaming request
(``--rounds`` requests of ``--tokens`` forced tokens, a fresh engine warmed up on the voice)
on each setting in turn. Prints every turn's first-chunk median and stage seconds, then
each setting's median over the turns.
"""

import argparse
import json
import os
import statistics
from pathlib import Path
from typing import Any

from precision_quality import parse_setting  # benchmarks/ is on the path when run as a script

from cosyserve.bench.engine_bench import BenchOptions, run_engine_bench
from cosyserve.engine.loader import load_model


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--settings", default="fp32+int8,fp32+int8+flow-fp16", help="two, comma-separated")
    parser.add_argument("--tokens", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--first-hop", type=int, default=5)
    parser.add_argument("--flow-prompt-whole", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    if len(settings) != 2:
        parser.error("--settings takes two settings")

    models = {}
    for setting in settings:
        dtype, quantize, compile_lm, flow_quantize = parse_setting(setting)
        models[setting] = load_model(
            args.model_dir, dtype=dtype, quantize=quantize, compile=compile_lm, flow_quantize=flow_quantize
        )
    options = BenchOptions(
        tokens=args.tokens,
        concurrency=(1,),
        stream=True,
        rounds=args.rounds,
        first_hop=args.first_hop,
        flow_prompt_whole=args.flow_prompt_whole,
    )
    turns: dict[str, list[dict[str, Any]]] = {setting: [] for setting in settings}
    print(f"load average before: {os.getloadavg()[0]:.2f}", flush=True)
    for turn in range(args.turns):
        for setting, model in models.items():
            level = run_engine_bench(model, options).levels[0]
            row = {
                "first_chunk_p50_s": level.first_chunk_s.p50,
                "total_p50_s": level.total_s.p50,
                "stage_s": level.stage_s,
                "load_average": os.getloadavg()[0],
            }
            turns[setting].append(row)
            print(f"turn {turn + 1} {setting}: {json.dumps(row)}", flush=True)
    summary = {
        setting: {
            "first_chunk_s_median_of_turns": statistics.median(r["first_chunk_p50_s"] for r in rows),
            "total_s_median_of_turns": statistics.median(r["total_p50_s"] for r in rows),
        }
        for setting, rows in turns.items()
    }
    print(json.dumps(summary, indent=2))
    if args.json:
        report = {"args": {k: str(v) for k, v in vars(args).items()}, "turns": turns, "summary": summary}
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
