"""The int8 LM's decoder Linears on fbgemm against oneDNN (``cosyserve.accel.onednn_int8``),
by rows per call, on a full-size model.

    python benchmarks/int8_kernels.py --model-dir /tmp/cv2-full-bench [--dtype bf16]
        [--rows 1,2,8,16,100] [--rounds 12] [--json out.json]

The model is loaded as the server loads it (``--quantize int8``), without our kernel
(``benchmarks/native_int8.py`` compares that one with fbgemm). For each row count, one
sweep calls every int8 Linear of the decoder that has oneDNN weights once, in order (as a
step or a prefill does: each weight read from memory), on random rows scaled as the
Linears scale them; three sweeps take turns for ``--rounds`` rounds (the first 2 not
counted): fbgemm with the fixed input grid (what a lone row runs), oneDNN (what calls of
``min_rows`` or more run), and fbgemm's dynamic op with the constant row that set its range
before 2026-12-05. It prints the median milliseconds and whether the three gave the same
bits (oneDNN's are fbgemm's from each weight's ``min_rows`` on, which the model never calls
it below), and the size of the oneDNN copies of the weights. Everything runs on a thread of its own with the
process's torch threads, as the engine does.
"""

import json
import os
from functools import partial
from typing import Any

import torch
from bench_args import model_parser  # benchmarks/ is on the path when run as a script
from interleave import interleaved

from cosyserve.accel.native_int8 import ENV_SWITCH
from cosyserve.accel.onednn_int8 import INPUT_SCALE, INPUT_ZERO_POINT, OneDnnInt8Weight
from cosyserve.accel.quantize import Int8DynamicLinear
from cosyserve.engine.loader import LoadedModel, load_model
from cosyserve.parallelism import call_on_own_thread, hand_over_threads


def main() -> None:
    parser = model_parser(__doc__)
    parser.add_argument("--rows", default="1,2,8,16,100", help="rows per call, comma-separated")
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    if args.quantize != "int8":
        raise SystemExit("the int8 kernels need --quantize int8")
    threads = hand_over_threads()
    os.environ[ENV_SWITCH] = "0"  # fbgemm keeps its weights: our kernel has its own script
    model = load_model(args.model_dir, dtype=args.dtype, quantize="int8", threads=threads)
    rows = [int(n) for n in args.rows.split(",")]
    report = call_on_own_thread(partial(measure, model, rows, args.rounds), threads=threads, name="bench")
    report["precision"] = model.precision.describe()
    print(json.dumps(report, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))


def measure(model: LoadedModel, row_counts: list[int], rounds: int) -> dict[str, Any]:
    linears = [m for m in model.lm.qwen.layers.modules() if isinstance(m, Int8DynamicLinear)]
    packed = [(m, m.onednn) for m in linears if m.onednn is not None]
    report: dict[str, Any] = {
        "linears": len(linears),
        "on_onednn": len(packed),
        "min_rows": sorted({w.min_rows for _, w in packed}),
        "onednn_weights_mib": sum(w.in_features * w.scales.shape[0] for _, w in packed) / 2**20,
    }
    if not packed:
        report["note"] = "oneDNN is not used here (no AMX tiles, or other bits than fbgemm)"
        return report
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for count in row_counts:
            # Rows as the Linears quantize them: within [-1, 1], each reaching an end.
            inputs = {m.in_features: torch.rand(count, m.in_features, generator=gen) * 2 - 1 for m in linears}
            for x in inputs.values():
                x[:, 0] = 1.0
            variants = {name: partial(sweep, packed, inputs) for name, sweep in SWEEPS.items()}
            medians, outputs = interleaved(variants, lambda: None, rounds, warm_up=2)
            first, *others = outputs.values()
            same = all(torch.equal(a, b) for other in others for a, b in zip(first, other, strict=True))
            report[f"rows_{count}"] = {
                **{f"{k}_ms": v for k, v in medians.items()},
                "same_bits": same,
                # Fewer rows than a weight's min_rows never reach oneDNN in the model.
                "onednn_in_the_model": count >= max(report["min_rows"]),
            }
    return report


Packed = list[tuple[Int8DynamicLinear, OneDnnInt8Weight]]


def _fbgemm(packed: Packed, inputs: dict[int, torch.Tensor]) -> list[torch.Tensor]:
    op = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32.default
    return [op(inputs[m.in_features], INPUT_SCALE, INPUT_ZERO_POINT, m.packed) for m, _ in packed]


def _onednn(packed: Packed, inputs: dict[int, torch.Tensor]) -> list[torch.Tensor]:
    return [weight(inputs[m.in_features]) for m, weight in packed]


def _fbgemm_range_row(packed: Packed, inputs: dict[int, torch.Tensor]) -> list[torch.Tensor]:
    op = torch.ops.quantized.linear_dynamic.default
    return [
        op(torch.cat([inputs[m.in_features], _range_row(m.in_features)]), m.packed, True)[:-1]
        for m, _ in packed
    ]


SWEEPS = {"fbgemm": _fbgemm, "onednn": _onednn, "fbgemm_range_row": _fbgemm_range_row}


def _range_row(width: int) -> torch.Tensor:
    """The constant row that set the dynamic op's range to [-1, 1] before 2026-12-05."""
    row = torch.zeros(1, width)
    row[0, :2] = torch.tensor([-1.0, 1.0])
    return row


if __name__ == "__main__":
    main()
