"""The int8 LM on our kernel (``cosyserve.accel.native_int8``) against fbgemm, on a full-size
model: its 97 int8 Linears by rows per call, and whole traced decode steps.

    python benchmarks/native_int8.py --model-dir /tmp/cv2-full-bench [--dtype bf16]
        [--rows 1,2,8,16,64,128,300] [--batches 1,2,8] [--rounds 15] [--json out.json]

The model is loaded twice as the server loads it (``--quantize int8``): once with the
kernel and once with ``COSYSERVE_NATIVE_INT8=0`` (fbgemm). For each row count one sweep
calls every int8 Linear once, in order (each weight read from memory, as in a step or a
prefill), on random rows; for each batch size, a decode step replayed from the engine's
traces over 8 prefilled sequences of 100-149 positions, each step undone after it (host
bookkeeping, timed with it). The two models take turns for ``--rounds`` rounds (the first 3
not counted); the script prints the median milliseconds and whether both gave the same
bits. Everything runs on a thread of its own with the process's torch threads, as the
engine does.
"""

import json
import os
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from bench_args import model_parser  # benchmarks/ is on the path when run as a script
from interleave import interleaved
from traced_decode import prefilled_slots, undo_step

from cosyserve.accel.native_int8 import ENV_SWITCH
from cosyserve.accel.quantize import Int8DynamicLinear
from cosyserve.engine.decode_graphs import DecodeGraphs, TraceCapture
from cosyserve.engine.loader import LoadedModel, load_model
from cosyserve.memory import retain_freed_memory
from cosyserve.models.kv_cache import KVCache
from cosyserve.parallelism import call_on_own_thread, hand_over_threads

WARM_UP = 3


def main() -> None:
    parser = model_parser(__doc__)
    parser.add_argument("--rows", default="1,2,8,16,64,128,300", help="rows per call, comma-separated")
    parser.add_argument("--batches", default="1,2,8", help="decode batch sizes, comma-separated")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    if args.quantize != "int8":
        raise SystemExit("the int8 kernels need --quantize int8")
    retain_freed_memory()  # as the engine does
    threads = hand_over_threads()
    models = {}
    for name, switch in (("native", "1"), ("fbgemm", "0")):
        os.environ[ENV_SWITCH] = switch
        models[name] = load_model(args.model_dir, dtype=args.dtype, quantize="int8", threads=threads)
    on_kernel = [m.native is not None for m in _linears(models["native"])]
    if not all(on_kernel):
        raise SystemExit(f"the kernel runs {sum(on_kernel)} of {len(on_kernel)} int8 Linears here")
    rows = [int(n) for n in args.rows.split(",")]
    batches = [int(n) for n in args.batches.split(",")]
    run = partial(measure, models, rows, batches, args.rounds)
    report = call_on_own_thread(run, threads=threads, name="bench")
    report["precision"] = models["native"].precision.describe()
    print(json.dumps(report, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))


def _linears(model: LoadedModel) -> list[Int8DynamicLinear]:
    return [m for m in model.lm.modules() if isinstance(m, Int8DynamicLinear)]


@torch.inference_mode()
def measure(
    models: dict[str, LoadedModel], row_counts: list[int], batches: list[int], rounds: int
) -> dict[str, Any]:
    report: dict[str, Any] = {"linears": len(_linears(models["native"])), "threads": torch.get_num_threads()}
    gen = torch.Generator().manual_seed(0)
    widths = {m.in_features for m in _linears(models["native"])}
    for count in row_counts:
        inputs = {width: torch.randn(count, width, generator=gen) for width in widths}
        sweeps = {name: partial(_sweep, _linears(model), inputs) for name, model in models.items()}
        medians, outputs = interleaved(sweeps, lambda: None, rounds, WARM_UP)
        same = all(torch.equal(a, b) for a, b in zip(outputs["native"], outputs["fbgemm"], strict=True))
        report[f"linears_rows_{count}"] = {**{f"{k}_ms": v for k, v in medians.items()}, "same_bits": same}
        print(count, "rows:", report[f"linears_rows_{count}"], flush=True)
    steps = {name: _decoder(model) for name, model in models.items()}
    for batch in batches:
        tokens = torch.randint(0, models["native"].lm.cfg.speech_token_size, (batch,), generator=gen)
        variants = {name: partial(step, tokens) for name, step in steps.items()}
        medians, outputs = interleaved(variants, lambda: None, rounds, WARM_UP)
        same = torch.equal(outputs["native"], outputs["fbgemm"])
        report[f"decode_batch_{batch}"] = {**{f"{k}_ms": v for k, v in medians.items()}, "same_bits": same}
        print("batch", batch, "step:", report[f"decode_batch_{batch}"], flush=True)
    return report


def _sweep(linears: list[Int8DynamicLinear], inputs: dict[int, torch.Tensor]) -> list[torch.Tensor]:
    return [m(inputs[m.in_features]) for m in linears]


def _decoder(model: LoadedModel) -> Callable[[torch.Tensor], torch.Tensor]:
    """A traced decode step of ``model`` over the slots of ``traced_decode.prefilled_slots``
    (the same prompts for every model), undone after it (the host's bookkeeping only: every
    round decodes the same position)."""
    lm = model.lm
    cache = KVCache.for_config(lm.cfg.qwen, 16, 2048, model.precision.kv_cache_dtype)
    graphs = DecodeGraphs.for_engine(lm, cache, TraceCapture(lm), 16)
    slots = prefilled_slots(lm, cache, torch.Generator().manual_seed(1))

    def step(tokens: torch.Tensor) -> torch.Tensor:
        active = slots[: tokens.shape[0]]
        log_probs = graphs.decode(tokens, active)
        undo_step(cache, active)
        return log_probs

    return step


if __name__ == "__main__":
    main()
