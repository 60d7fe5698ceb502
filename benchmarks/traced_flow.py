"""The flow with the estimator's calls replayed from traces (``Flow.trace_steps_``,
``EngineConfig.traced_flow``) against eager calls, on a full-size model: what tracing
costs at start and what it saves, streaming and not.

    python benchmarks/traced_flow.py --model-dir /tmp/cv2-full-bench [--dtype bf16]
        [--quantize int8] [--prompt 75] [--tokens 150] [--first-hop 5] [--rounds 8]
        [--json out.json]

The model is loaded as the server loads it. The script times the capture of the traces
and reads the process's resident memory before and after it. A voice prompt of
``--prompt`` random tokens is primed whole (``flow_prompt_whole``), and a stream of
``--tokens`` tokens forked from it is cut as the engine cuts it (first chunk after
``--first-hop`` tokens). Eager and traced take turns for ``--rounds`` rounds (the first
not counted): the first chunk alone, then whole streams and then the same tokens'
non-streaming flow (a third as many rounds each). It prints the median seconds and the
largest difference between the two sides' mel frames (0.0 where the replays give the
eager calls' bits). Everything runs on a thread of its
own with the process's torch threads, as the engine does.
"""

import argparse
import json
import time
from functools import partial
from typing import Any

import torch
from bench_args import add_workload_args, model_parser  # benchmarks/ is on the path when run as a script
from interleave import interleaved

from cosyserve.engine.chunking import ChunkSchedule
from cosyserve.engine.loader import LoadedModel, load_model
from cosyserve.models.flow import Flow
from cosyserve.models.flow.stream_cache import FlowStreamCache
from cosyserve.parallelism import call_on_own_thread, hand_over_threads
from cosyserve.server.observability.watchdog import read_rss_bytes


def main() -> None:
    parser = model_parser(__doc__)
    add_workload_args(parser, first_hop=True)
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    threads = hand_over_threads()
    model = load_model(args.model_dir, dtype=args.dtype, quantize=args.quantize, threads=threads)
    report = call_on_own_thread(partial(measure, model, args), threads=threads, name="bench")
    report["precision"] = model.precision.describe()
    print(json.dumps(report, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))


def measure(model: LoadedModel, args: argparse.Namespace) -> dict[str, Any]:
    flow = model.flow
    gen = torch.Generator().manual_seed(0)
    voice = (
        torch.randint(0, flow.cfg.vocab_size, (1, args.prompt), generator=gen),
        torch.randn(1, flow.token_mel_ratio * args.prompt, flow.cfg.output_size, generator=gen),
        torch.randn(1, flow.cfg.spk_embed_dim, generator=gen),
    )
    tokens = torch.randint(0, flow.cfg.vocab_size, (1, args.tokens), generator=gen)
    primed = flow.prime_stream(*voice, whole=True)
    before = read_rss_bytes() / 2**20
    start = time.perf_counter()
    traced = flow.trace_steps_()
    report: dict[str, Any] = {
        "traced": traced,
        "traces": 0 if flow.cfm.traced_steps is None else flow.cfm.traced_steps.traces,
        "capture_s": time.perf_counter() - start,
        "rss_before_capture_mib": before,
        "rss_after_capture_mib": read_rss_bytes() / 2**20,
    }
    steps = flow.cfm.traced_steps
    variants = {"eager": None, "traced": steps}

    def stream(name: str, first_only: bool) -> list[torch.Tensor]:
        flow.cfm.traced_steps = variants[name]
        return _stream(flow, primed.fork(), tokens, voice, args.prompt, args.first_hop, first_only)

    def non_streaming(name: str) -> list[torch.Tensor]:
        flow.cfm.traced_steps = variants[name]
        return [flow.inference(tokens, *voice, streaming=False, finalize=True)]

    whole_rounds = max(2, args.rounds // 3)
    workloads = {
        "first_chunk": (partial(stream, first_only=True), args.rounds),
        "stream": (partial(stream, first_only=False), whole_rounds),
        "non_streaming": (non_streaming, whole_rounds),
    }
    for label, (run, rounds) in workloads.items():
        runs = {name: partial(run, name) for name in variants}
        medians, outputs = interleaved(runs, lambda: None, rounds, warm_up=1)
        report[label] = {
            **{f"{name}_s": ms / 1e3 for name, ms in medians.items()},
            "chunks": len(outputs["eager"]),
            "max_mel_difference": max(
                (e - t).abs().max().item() for e, t in zip(outputs["eager"], outputs["traced"], strict=True)
            ),
        }
    flow.cfm.traced_steps = steps
    return report


def _stream(
    flow: Flow,
    cache: FlowStreamCache,
    tokens: torch.Tensor,
    voice: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    prompt: int,
    first_hop: int,
    first_only: bool,
) -> list[torch.Tensor]:
    """The stream's chunks (only the first if ``first_only``), cut as the engine cuts them."""
    schedule = ChunkSchedule(
        prompt, hop=flow.cfg.encoder.static_chunk_size, lookahead=flow.pre_lookahead_len, first_hop=first_hop
    )
    mels = []
    while (chunk := schedule.next_chunk(tokens.shape[1], finished=True)) is not None:
        mels.append(flow.stream(cache, tokens[:, : chunk.token_end], *voice, chunk.offset, chunk.finalize))
        if first_only:
            break
    return mels


if __name__ == "__main__":
    main()
