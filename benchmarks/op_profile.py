"""Where each stage's time goes by kind of op, against this CPU's measured peaks.

    .venv/bin/python benchmarks/op_profile.py --model-dir /tmp/cv2-full-bench \\
        [--dtype bf16 --quantize int8] [--compile] [--json FILE]

The workload of docs/benchmarks.md (a 3 s voice prompt, 150 speech tokens), one stage at a
time on a thread of its own with the process's torch threads and malloc's thresholds set
as the engine sets them (``memory.retain_freed_memory``):

- ``flow, non-streaming``: one ``Flow.inference`` over prompt + tokens;
- ``flow, first chunk``: a stream's first chunk (``--first-hop`` tokens) forked from the
  voice's primed prompt states, what a stream's first audio waits for;
- ``LM decode step``: one step of one sequence over ``--prompt`` + 25 cached positions;
- ``HiFT``: vocoding the tokens' mel frames.

Each runs once to warm up, ``--repeats`` times for its wall time (median), once under
``torch.profiler`` (times) and once for its FLOPs (``roofline.flop_counts``: matrix
products, convolutions and attention, the last on torch's math backend; the profiler's
own FLOP counting slows the ops it times several-fold; int8 Linears have no count).
The ops are grouped by kind; each group gets its time inside ops (the profiler's self
time), its FLOPs and the rate they ran at, against the peaks of ``benchmarks/roofline.py``
measured in the same process. "outside ops" is the profiled wall time spent in no op:
Python, dispatch and the profiler's own overhead.

``--compile`` also times one estimator call (both CFG rows, the non-streaming length)
eager against ``torch.compile`` (inductor, weight freezing, static shapes): the compile
time, both times and their outputs' largest difference.
"""

import argparse
import json
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from bench_args import add_workload_args, model_parser  # benchmarks/ is on the path when run as a script
from roofline import flop_counts, measure_peaks
from torch.profiler import ProfilerActivity, profile

from cosyserve.engine.chunking import ChunkSchedule
from cosyserve.engine.loader import LoadedModel, load_model
from cosyserve.memory import retain_freed_memory
from cosyserve.models.kv_cache import KVCache
from cosyserve.parallelism import call_on_own_thread, hand_over_threads

_INT8_LINEARS = ("linear_dynamic", "_weight_int8pack_mm", "qlinear_pointwise")
# Op kinds by the op's name without its namespace, first match wins: (kind, test).
KINDS: tuple[tuple[str, Callable[[str], bool]], ...] = (
    # The LM's int8 Linears: fbgemm's dynamic op under either name it is profiled by,
    # weight-only int8, and oneDNN's (AMX).
    ("int8 Linear", lambda op: op in _INT8_LINEARS or op.startswith("linear_with_input_q_dq")),
    ("matmul (Linear)", lambda op: op in ("addmm", "mm", "_linear_pointwise")),
    ("matmul (batched: attention)", lambda op: op in ("bmm", "baddbmm")),
    ("fused attention", lambda op: "scaled_dot_product" in op),
    ("softmax", lambda op: "softmax" in op),
    ("convolution", lambda op: "conv" in op),
    ("copy, cat", lambda op: op in ("copy_", "cat")),
)
OTHER, OUTSIDE = "other ops", "outside ops"


@dataclass(frozen=True)
class Workload:
    name: str
    run: Callable[[], object]
    gemm_dtype: str  # which measured GEMM peak its matrix products are held against


def main() -> None:
    parser = model_parser(__doc__)
    add_workload_args(parser, first_hop=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="also time a compiled estimator call")
    args = parser.parse_args()
    retain_freed_memory()  # as the engine does: new pages would be timed in the ops that fault them
    threads = hand_over_threads()
    report: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "threads": threads}
    report["load_average_before"] = os.getloadavg()
    model = load_model(args.model_dir, dtype=args.dtype, quantize=args.quantize, threads=threads)
    report["precision"] = model.precision.describe()
    report["peaks"] = call_on_own_thread(measure_peaks, threads=threads, name="peaks")
    report["workloads"] = {}
    for workload in workloads(model, args):
        result = call_on_own_thread(partial(measure, workload, args.repeats), threads=threads, name="stage")
        result["rows"] = _with_rates(result["rows"], report["peaks"][f"gemm_{workload.gemm_dtype}_gflops"])
        report["workloads"][workload.name] = result
        print(_table(workload.name, result), flush=True)
    if args.compile:
        compare = partial(compare_compiled, model, args)
        report["compile"] = call_on_own_thread(compare, threads=threads, name="compile")
        print(json.dumps(report["compile"], indent=2), flush=True)
    report["load_average_after"] = os.getloadavg()
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))


def workloads(model: LoadedModel, args: argparse.Namespace) -> list[Workload]:
    gen = torch.Generator().manual_seed(0)
    flow, hift = model.flow, model.hift
    prompt_token = torch.randint(0, flow.cfg.vocab_size, (1, args.prompt), generator=gen)
    prompt_feat = torch.randn(1, flow.token_mel_ratio * args.prompt, flow.cfg.output_size, generator=gen)
    embedding = torch.randn(1, flow.cfg.spk_embed_dim, generator=gen)
    token = torch.randint(0, flow.cfg.vocab_size, (1, args.tokens), generator=gen)
    voice = (prompt_token, prompt_feat, embedding)
    schedule = ChunkSchedule(
        args.prompt, hop=flow.cfg.encoder.static_chunk_size, lookahead=flow.pre_lookahead_len,
        first_hop=args.first_hop,
    )  # fmt: skip
    chunk = schedule.next_chunk(args.tokens, finished=False)
    if chunk is None:
        raise SystemExit(f"--tokens {args.tokens} is too few for a first chunk")
    primed = flow.prime_stream(*voice)
    mel = torch.randn(1, flow.cfg.output_size, flow.token_mel_ratio * args.tokens, generator=gen) - 6.0
    flow_dtype, lm_dtype = _peak_dtype(model.precision.flow_dtype), _peak_dtype(model.precision.lm_dtype)
    return [
        Workload(
            "flow, non-streaming",
            partial(flow.inference, token, *voice, streaming=False, finalize=True),
            flow_dtype,
        ),
        Workload(
            f"flow, first chunk ({args.first_hop} tokens, primed voice)",
            lambda: flow.stream(primed.fork(), token[:, : chunk.token_end], *voice, chunk.offset, False),
            flow_dtype,
        ),
        Workload("LM decode step (batch 1)", _decode_step(model, args.prompt + 25), lm_dtype),
        Workload("HiFT", partial(hift.inference, mel, generator=torch.Generator().manual_seed(0)), "fp32"),
    ]


def _peak_dtype(dtype: torch.dtype) -> str:
    """Which measured GEMM peak (``bf16`` or ``fp32``) matmuls in ``dtype`` are held against."""
    return "bf16" if dtype == torch.bfloat16 else "fp32"


def _decode_step(model: LoadedModel, cached: int) -> Callable[[], object]:
    """One decode step over ``cached`` positions, the cache rewound after each step."""
    lm = model.lm
    cache = KVCache.for_config(lm.cfg.qwen, 1, cached + 1, model.precision.kv_cache_dtype)
    slot = cache.allocate()
    with torch.inference_mode():
        lm.prefill(lm.speech_embedding(torch.zeros(cached, dtype=torch.long)), slot, cache)
    token = torch.zeros(1, dtype=torch.long)

    @torch.inference_mode()
    def step() -> None:
        lm.decode(token, [slot], cache)
        cache.truncate(slot, cached)

    return step


@torch.inference_mode()
def measure(workload: Workload, repeats: int) -> dict[str, Any]:
    workload.run()
    walls = []
    for _ in range(repeats):
        start = time.perf_counter()
        workload.run()
        walls.append(time.perf_counter() - start)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        workload.run()
        profiled = time.perf_counter() - start
    rows: defaultdict[str, dict[str, float]] = defaultdict(lambda: {"ms": 0.0, "flops": 0.0, "calls": 0})
    for event in prof.key_averages():
        row = rows[_kind(event.key)]
        row["ms"] += event.self_cpu_time_total / 1e3
        row["calls"] += event.count if event.self_cpu_time_total else 0
    for op, flops in flop_counts(workload.run).items():
        rows[_kind(op)]["flops"] += flops
    inside = sum(row["ms"] for row in rows.values())
    rows[OUTSIDE]["ms"] = max(0.0, 1e3 * profiled - inside)
    wall = statistics.median(walls)
    return {"wall_s": wall, "walls_s": walls, "profiled_wall_s": profiled, "rows": dict(rows)}


def _kind(name: str) -> str:
    """The kind of op ``name`` (``aten::mm`` from the profiler, ``aten.mm`` from the counter)."""
    op = name.replace("::", ".").split(".")[1] if "::" in name or "." in name else name
    for kind, test in KINDS:
        if test(op):
            return kind
    return OTHER


def _with_rates(rows: dict[str, dict[str, float]], peak_gflops: float) -> dict[str, dict[str, float]]:
    """Each row with counted FLOPs, with its GFLOP/s and share of the measured GEMM peak."""
    for row in rows.values():
        if row["flops"] and row["ms"]:
            row["gflops_per_s"] = row["flops"] / row["ms"] / 1e6
            row["of_peak"] = row["gflops_per_s"] / peak_gflops
    return rows


def _table(name: str, result: dict[str, Any]) -> str:
    total = 1e3 * result["profiled_wall_s"]
    lines = [
        f"\n{name}: wall {result['wall_s']:.3f} s (median), profiled {result['profiled_wall_s']:.3f} s\n",
        "| ops | ms | share | calls | GFLOP | GFLOP/s | of measured peak |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for kind, row in sorted(result["rows"].items(), key=lambda item: -item[1]["ms"]):
        rate = f"{row['gflops_per_s']:.0f} | {100 * row['of_peak']:.0f} %" if "of_peak" in row else "| "
        gflop = f"{row['flops'] / 1e9:.1f}" if "of_peak" in row else ""
        calls = str(int(row["calls"])) if row["calls"] else ""
        share = f"{100 * row['ms'] / total:.0f} %"
        lines.append(f"| {kind} | {row['ms']:.0f} | {share} | {calls} | {gflop} | {rate} |")
    return "\n".join(lines)


@torch.inference_mode()
def compare_compiled(model: LoadedModel, args: argparse.Namespace) -> dict[str, float]:
    """One estimator call at the non-streaming length, eager against compiled."""
    import torch._inductor.config as inductor_config

    estimator = model.flow.cfm.estimator
    dtype = model.precision.flow_dtype
    frames = model.flow.token_mel_ratio * (args.prompt + args.tokens)
    gen = torch.Generator().manual_seed(0)
    x, mu, cond = (torch.randn(2, 80, frames, generator=gen).to(dtype) for _ in range(3))
    inputs = (x, torch.ones(2, 1, frames, dtype=dtype), mu, torch.full((2,), 0.3, dtype=dtype))
    inputs += (torch.randn(2, 80, generator=gen).to(dtype), cond, None)

    def timed(fn: Callable[..., torch.Tensor]) -> float:
        fn(*inputs)
        walls = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            fn(*inputs)
            walls.append(time.perf_counter() - start)
        return statistics.median(walls)

    eager = timed(estimator)
    inductor_config.freezing = True  # without it the compiled CPU model is slower than eager
    compiled = torch.compile(estimator, dynamic=False)
    start = time.perf_counter()
    out = compiled(*inputs)
    compile_s = time.perf_counter() - start
    reference = estimator(*inputs).float()
    difference = float((out.float() - reference).abs().max())
    return {
        "frames": frames,
        "eager_s": eager,
        "compiled_s": timed(compiled),
        "eager_again_s": timed(estimator),
        "compile_s": compile_s,
        "max_abs_difference": difference,
        "eager_output_std": float(reference.std()),
    }


if __name__ == "__main__":
    main()
