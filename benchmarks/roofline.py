"""How far each synthesis stage is from this CPU's limits: work per stage against peaks.

    python benchmarks/roofline.py /tmp/cv2-full-bench --threads 2 --out /tmp/roofline.json

For the standard workload of docs/benchmarks.md (``--text`` text ids, a ``--prompt``-token
voice prompt, ``--tokens`` speech tokens), counts the work of each stage on the given
model directory, measures the machine's practical peaks, and prints the shortest time each
stage could take at those peaks:

- LM prefill: FLOPs of one causal pass over sos + text + task id + prompt tokens.
- LM decode: per step, the bytes of every weight read once (decode at small batch is
  bound by memory traffic, not arithmetic) plus its FLOPs; for fp32, bf16 and int8 weights.
- Flow: FLOPs of one non-streaming pass over prompt + tokens (10 Euler steps x 2 CFG rows).
- HiFT: FLOPs of vocoding the tokens' mel frames.

FLOPs come from ``torch.utils.flop_counter`` (matmuls, convolutions and attention, the
last counted on torch's math backend; the elementwise work it does not count is small
next to them, but not its time: see ``benchmarks/op_profile.py``). Peaks are measured here:
large fp32 and bf16 GEMMs, an int8 dynamic-quantized Linear, and streaming reads of a
1 GiB tensor; the theoretical peak (Zen 4: one 512-bit FMA per cycle per core = 32 fp32 or
64 bf16 FLOPs per cycle) is printed beside them. With ``--times FILE`` (the JSON of
``benchmarks/precision_quality.py``) the measured stage times are set against the bounds.
"""

import argparse
import functools
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from bench_args import add_workload_args  # benchmarks/ is on the path when run as a script
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode, register_flop_formula

from cosyserve.engine.loader import LoadedModel, load_model

SEED = 1234
FLOPS_PER_CYCLE = {"fp32": 32, "bf16": 64}  # per core, Zen 4 AVX-512 (512-bit FMA in 2 halves)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--text", type=int, default=30)
    add_workload_args(parser)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    parser.add_argument("--times", type=Path, default=None, help="precision_quality.py JSON")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    peaks = measure_peaks()
    model = load_model(args.model_dir)
    work = stage_work(model, args.text, args.prompt, args.tokens)
    report = {"threads": torch.get_num_threads(), "load_avg_1m": os.getloadavg()[0], "peaks": peaks}
    report["work"] = work
    if args.times is not None:
        report["times"] = json.loads(args.times.read_text())["results"]
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2))
    print(markdown(report))


def measure_peaks() -> dict[str, float]:
    """Practical peaks of this process's threads: GFLOP/s of large GEMMs, GOP/s of an int8
    dynamic Linear, GB/s of streaming reads; and the nominal clock in GHz."""
    gen = torch.Generator().manual_seed(SEED)
    n = 2048
    peaks: dict[str, float] = {"ghz": _clock_ghz()}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a = torch.randn(n, n, generator=gen).to(dtype)
        b = torch.randn(n, n, generator=gen).to(dtype)
        peaks[f"gemm_{name}_gflops"] = 2 * n**3 / _best(lambda a=a, b=b: a @ b) / 1e9
    linear = torch.nn.Sequential(torch.nn.Linear(n, n, bias=False))
    int8 = torch.ao.quantization.quantize_dynamic(linear, {torch.nn.Linear}, dtype=torch.qint8)
    x = torch.randn(n, n, generator=gen)
    peaks["gemm_int8_gops"] = 2 * n**3 / _best(lambda: int8(x)) / 1e9
    big = torch.ones(256 * 1024 * 1024)  # 1 GiB of float32
    peaks["read_gbs"] = big.numel() * 4 / _best(big.sum) / 1e9
    return peaks


def stage_work(model: LoadedModel, text: int, prompt: int, tokens: int) -> dict[str, dict[str, float]]:
    """FLOPs (and for decode, bytes) of each stage for the workload."""
    gen = torch.Generator().manual_seed(SEED)
    lm, flow, hift = model.lm, model.flow, model.hift
    speech = lm.cfg.speech_token_size
    text_ids = torch.randint(0, lm.cfg.qwen.vocab_size, (text,), generator=gen)
    prompt_ids = torch.randint(0, speech, (prompt,), generator=gen)
    token_ids = torch.randint(0, speech, (tokens,), generator=gen)
    prompt_mel = torch.randn(1, 2 * prompt, 80, generator=gen) - 6.0
    embedding = torch.randn(1, 192, generator=gen)
    work: dict[str, dict[str, float]] = {}
    with torch.inference_mode():
        prefill = lm.prompt_embeddings(text_ids, prompt_ids)[None]
        work["lm_prefill"] = {
            "positions": prefill.shape[1],
            "flops": _flops(lambda: lm.teacher_forced(prefill)),
        }
        decoder = sum(p.numel() for n, p in lm.named_parameters() if ".layers." in n and p.dim() == 2)
        head = sum(p.numel() for n, p in lm.named_parameters() if n.startswith("llm_decoder."))
        params = decoder + head
        work["lm_decode_step"] = {
            "flops": 2 * params,
            "weights": params,
            **{f"bytes_{name}": params * size for name, size in (("fp32", 4), ("bf16", 2), ("int8", 1))},
        }
        mel_flops = _flops(
            lambda: flow.inference(
                token_ids[None], prompt_ids[None], prompt_mel, embedding, streaming=False, finalize=True
            )
        )
        work["flow"] = {"frames": 2 * (prompt + tokens), "flops": mel_flops}
        mel = torch.randn(1, 80, 2 * tokens, generator=gen) - 6.0
        work["hift"] = {
            "frames": 2 * tokens,
            "flops": _flops(lambda: hift.inference(mel, generator=torch.Generator().manual_seed(0))),
        }
    return work


def markdown(report: dict[str, Any]) -> str:
    peaks, work = report["peaks"], report["work"]
    threads = report["threads"]
    theory = {k: v * peaks["ghz"] * threads for k, v in FLOPS_PER_CYCLE.items()}
    lines = [
        f"Threads {threads}, load average {report['load_avg_1m']:.2f}, nominal clock {peaks['ghz']:.2f} GHz.",
        "",
        "| peak | measured | theoretical at the nominal clock |",
        "|---|---:|---:|",
        f"| fp32 GEMM (GFLOP/s) | {peaks['gemm_fp32_gflops']:.0f} | {theory['fp32']:.0f} |",
        f"| bf16 GEMM (GFLOP/s) | {peaks['gemm_bf16_gflops']:.0f} | {theory['bf16']:.0f} |",
        f"| int8 dynamic Linear (GOP/s) | {peaks['gemm_int8_gops']:.0f} | |",
        f"| memory read (GB/s) | {peaks['read_gbs']:.1f} | |",
        "",
        "| stage | work | bound at measured fp32 peak | bound at measured bf16 / int8 peak |",
        "|---|---|---:|---:|",
    ]
    fp32, bf16, read = (
        peaks["gemm_fp32_gflops"] * 1e9,
        peaks["gemm_bf16_gflops"] * 1e9,
        peaks["read_gbs"] * 1e9,
    )
    prefill = work["lm_prefill"]
    lines.append(
        f"| LM prefill ({prefill['positions']} positions) | {prefill['flops'] / 1e9:.0f} GFLOP "
        f"| {prefill['flops'] / fp32:.2f} s | {prefill['flops'] / bf16:.2f} s |"
    )
    step = work["lm_decode_step"]
    gbytes = " / ".join(f"{step[f'bytes_{w}'] / 1e9:.2f}" for w in ("fp32", "bf16", "int8"))
    lines.append(
        f"| LM decode step (batch 1) | {step['weights'] / 1e6:.0f} M weights read: {gbytes} GB "
        f"(fp32 / bf16 / int8) | {1000 * step['bytes_fp32'] / read:.0f} ms | "
        f"{1000 * step['bytes_bf16'] / read:.0f} / {1000 * step['bytes_int8'] / read:.0f} ms |"
    )
    for name in ("flow", "hift"):
        stage = work[name]
        lines.append(
            f"| {name} ({stage['frames']} frames) | {stage['flops'] / 1e9:.0f} GFLOP "
            f"| {stage['flops'] / fp32:.2f} s | {stage['flops'] / bf16:.2f} s |"
        )
    for result in report.get("times", []):
        lines.append(_achieved(result, work, fp32, bf16, read))
    return "\n".join(lines)


def _achieved(
    result: dict[str, Any], work: dict[str, dict[str, float]], fp32: float, bf16: float, read: float
) -> str:
    """One line per precision setting: measured stage times as a fraction of the bound."""
    dtype, _, quantize = result["setting"].partition("+")
    gemm = bf16 if dtype == "bf16" else fp32
    weights = "int8" if quantize.startswith("int8") else dtype
    step_bytes = work["lm_decode_step"][f"bytes_{weights}"]
    decode = result["decode_b1_ms"] / 1000
    flow_rate = work["flow"]["flops"] / result["flow_s"]
    hift_rate = work["hift"]["flops"] / result["hift_s"]
    return (
        f"\n{result['setting']}: decode b1 {1000 * decode:.0f} ms = {step_bytes / decode / 1e9:.1f} GB/s "
        f"({100 * step_bytes / decode / read:.0f}% of measured read bandwidth); "
        f"flow {result['flow_s']:.2f} s = {flow_rate / 1e9:.0f} GFLOP/s "
        f"({100 * flow_rate / gemm:.0f}% of the {dtype} GEMM peak); "
        f"HiFT (fp32) {result['hift_s']:.2f} s = {hift_rate / 1e9:.0f} GFLOP/s "
        f"({100 * hift_rate / fp32:.0f}%)"
    )


def flop_counts(fn: Callable[[], object]) -> dict[str, float]:
    """FLOPs of ``fn()`` per op (``aten.mm``, ...), attention included: scaled dot-product
    attention runs its math backend here (batched matmuls), since torch's counter has no
    formula for the CPU flash kernel and counted it as 0 (the flow's 469 GFLOP). The packed
    bf16 Linears (``mkldnn._linear_pointwise``) get a formula of their own."""
    _count_packed_linears()
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        fn()
    return {str(op): float(flops) for op, flops in counter.get_flop_counts()["Global"].items()}


@functools.cache
def _count_packed_linears() -> None:
    """Teach torch's FLOP counter ``mkldnn._linear_pointwise`` (``PackedLinear``): it has no
    formula for it and counted the bf16 flow's Linears, most of its FLOPs, as 0. The packed
    weight reports its logical shape ``(out, in)``."""

    @register_flop_formula(torch.ops.mkldnn._linear_pointwise)
    def linear_pointwise(x_shape: torch.Size, w_shape: torch.Size, *args: object, **kwargs: object) -> int:
        return 2 * math.prod(x_shape[:-1]) * x_shape[-1] * w_shape[0]


def _flops(fn: Callable[[], object]) -> float:
    return sum(flop_counts(fn).values())


def _best(fn: Callable[[], object], repeats: int = 5) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _clock_ghz() -> float:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("cpu MHz"):
            return float(line.split(":")[1]) / 1000
    return float("nan")


if __name__ == "__main__":
    main()
