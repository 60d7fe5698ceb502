"""A stream's first flow chunk and a non-streaming flow in variants of the estimator's
weights and convolutions; calls interleaved in one process.

    python benchmarks/flow_weights.py --model-dir /tmp/cv2-full-bench [--variants conv,fp32,fp16]
        [--json out.json]

The variants of the flow of ``--model-dir`` (loaded as the server loads it, q/k/v
stacked), the first listed being the reference:

- ``conv``: float32, every estimator convolution through torch's convolution
  (``GEMM_CONV_ROWS`` set to 0 around its calls), as before short convolutions ran as
  matrix products;
- ``fp32``: float32 as loaded by default;
- ``fp16``: float32 with the estimator's Linears on float16 weights
  (``quantize.fp16_weights_``, ``flow_quantize = fp16``);
- ``bf16``: bfloat16 with torch's ``F.linear``;
- ``bf16-packed``: bfloat16 with the estimator's Linears packed for oneDNN
  (``packed_linear.pack_linears_``, what loading a bf16 model does). Since 2026-12-06 its
  feed-forwards apply their GELU in the packed call, before rounding
  (``PackedLinear.gelu``), so its mel differs from ``bf16``'s by bfloat16 rounding.

Each runs a stream's first chunk of ``--first-hop`` tokens after a ``--prompt``-token voice
prompt primed whole (``Flow.prime_stream(whole=True)``, what the first audio waits for)
``--repeats`` times, the variants in turn within each repeat, and a non-streaming flow
over the prompt and ``--tokens`` tokens ``--full-repeats`` times. Prints each call's wall
and CPU seconds, the medians, and each variant's max and mean |mel difference| from the
reference.
"""

import argparse
import contextlib
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from flow_streaming import load_flow  # benchmarks/ is on the path when run as a script

from cosyserve.accel.quantize import fp16_weights_
from cosyserve.engine.chunking import ChunkSchedule
from cosyserve.models.flow import blocks
from cosyserve.models.flow.flow import Flow
from cosyserve.models.packed_linear import pack_linears_


def timed(call: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, float, float]:
    """``call()``'s result with its wall and CPU seconds."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = call()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--prompt", type=int, default=75, help="prompt speech tokens (75: 3 s)")
    parser.add_argument("--first-hop", type=int, default=5, help="first chunk's new tokens")
    parser.add_argument("--tokens", type=int, default=150, help="non-streaming tokens (150: 6 s)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--full-repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--variants", default="conv,fp32,fp16", help=f"from {', '.join(VARIANTS)}")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    names = args.variants.split(",")
    if unknown := set(names) - set(VARIANTS):
        parser.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    flows = {name: load_variant(args.model_dir, name) for name in names}
    reference = names[0]
    calls = {name: workloads(name, flow, args) for name, flow in flows.items()}

    runs: dict[str, dict[str, list[list[float]]]] = {name: {"first": [], "full": []} for name in flows}
    mels: dict[str, dict[str, torch.Tensor]] = {name: {} for name in flows}
    print(f"load average before: {os.getloadavg()[0]:.2f}", flush=True)
    print("run  variant  work    wall_s   cpu_s", flush=True)
    for work, repeats in (("first", args.repeats), ("full", args.full_repeats)):
        for i in range(repeats):
            for name in flows:
                with variant(name), torch.inference_mode():
                    mel, wall, cpu = timed(calls[name][work])
                mels[name][work] = mel
                runs[name][work].append([wall, cpu])
                print(f"{i + 1:>3}  {name:<7}  {work:<5} {wall:>8.3f} {cpu:>7.2f}", flush=True)

    summary: dict[str, Any] = {}
    for name in flows:
        row: dict[str, Any] = {}
        for work in ("first", "full"):
            row[f"{work}_median_wall_s"] = statistics.median(w for w, _ in runs[name][work])
            row[f"{work}_median_cpu_s"] = statistics.median(c for _, c in runs[name][work])
            diff = (mels[name][work].float() - mels[reference][work].float()).abs()
            row[f"{work}_mel_max_abs_diff"] = float(diff.max())
            row[f"{work}_mel_mean_abs_diff"] = float(diff.mean())
        summary[name] = row
        print(name, json.dumps(row), flush=True)
    mel_std = float(mels[reference]["full"].float().std())
    print(f"load average after: {os.getloadavg()[0]:.2f}; mel std {mel_std:.3f}")
    if args.json:
        report = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs, "summary": summary}
        args.json.write_text(json.dumps(report, indent=2))


VARIANTS = ("conv", "fp32", "fp16", "bf16", "bf16-packed")


def load_variant(model_dir: Path, name: str) -> Flow:
    flow = load_flow(model_dir, "full", 0)
    if name.startswith("bf16"):
        flow.to(torch.bfloat16)
    flow.fuse_projections_()
    if name == "fp16":
        fp16_weights_(flow.cfm.estimator)
    elif name == "bf16-packed" and not pack_linears_(flow.cfm.estimator):
        raise SystemExit("oneDNN packed bf16 Linears are unavailable here")
    return flow


def workloads(name: str, flow: Flow, args: argparse.Namespace) -> dict[str, Callable[[], torch.Tensor]]:
    """The first chunk (from a fork of the whole-primed voice) and the non-streaming flow,
    on the same random voice and tokens for every variant."""
    gen = torch.Generator().manual_seed(1)
    vocab = flow.cfg.vocab_size
    voice = (
        torch.randint(0, vocab, (1, args.prompt), generator=gen),
        torch.randn(1, 2 * args.prompt, flow.cfg.output_size, generator=gen),
        torch.randn(1, flow.cfg.spk_embed_dim, generator=gen),
    )
    tokens = torch.randint(0, vocab, (1, args.tokens), generator=gen)
    schedule = ChunkSchedule(
        args.prompt,
        hop=flow.cfg.encoder.static_chunk_size,
        lookahead=flow.cfg.pre_lookahead_len,
        first_hop=args.first_hop,
    )
    chunk = schedule.next_chunk(args.tokens, finished=False)
    if chunk is None:
        raise SystemExit(f"--tokens {args.tokens} is too few for a first chunk")
    with variant(name), torch.inference_mode():
        whole = flow.prime_stream(*voice, whole=True)
    return {
        "first": lambda: flow.stream(whole.fork(), tokens[:, : chunk.token_end], *voice, chunk.offset, False),
        "full": lambda: flow.inference(tokens, *voice, streaming=False, finalize=True),
    }


@contextlib.contextmanager
def variant(name: str) -> Iterator[None]:
    """Within it, for ``conv``, every convolution runs through torch's convolution."""
    rows = blocks.GEMM_CONV_ROWS
    if name == "conv":
        blocks.GEMM_CONV_ROWS = 0
    try:
        yield
    finally:
        blocks.GEMM_CONV_ROWS = rows


if __name__ == "__main__":
    main()
