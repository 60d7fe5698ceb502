"""A flow call's later Euler steps replayed from a CUDA graph (``CFM.step_capture``,
``EngineConfig.cuda_graphs``) against eager steps, on a full-size model on a GPU.

    python benchmarks/flow_graphs.py --model-dir DIR [--dtype bf16] [--quantize none]
        [--prompt 75] [--tokens 150] [--rows 16] [--chunk 30] [--rounds 6] [--json out.json]

Two calls, each without cached state, as the engine makes them on a GPU: a non-streaming
request's flow (``--prompt`` prompt tokens and ``--tokens`` tokens, one row) and an
``exact`` streaming chunk of ``--rows`` streams batched (each ``--chunk`` tokens after
its prompt, of different voices). Eager and graphed steps take turns for ``--rounds``
rounds (the first not counted); the script prints the median milliseconds of each, the
peak GPU memory torch allocated during each, and the largest difference between their
mel frames.
"""

import json
from collections.abc import Callable
from typing import Any

import torch
from common import add_workload_args, interleaved, model_parser  # benchmarks/, the script's own directory

from cosyserve.engine.loader import load_model
from cosyserve.models.flow import Flow
from cosyserve.models.flow.rows import FlowRow, infer_rows
from cosyserve.models.flow.step_graph import CudaStepCapture


def main() -> None:
    parser = model_parser(__doc__)
    parser.set_defaults(quantize="none")
    add_workload_args(parser)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    device = torch.device("cuda")
    model = load_model(args.model_dir, dtype=args.dtype, quantize=args.quantize, device="cuda")
    flow = model.flow
    gen = torch.Generator().manual_seed(0)
    voices = [_row(flow, args.prompt, args.chunk, gen, device) for _ in range(args.rows)]
    whole = [_row(flow, args.prompt, args.tokens, gen, device)]
    report: dict[str, Any] = {"precision": model.precision.describe(), "device": torch.cuda.get_device_name()}
    calls = {
        f"non-streaming, 1 row, {args.tokens} tokens": lambda: _mels(flow, whole, streaming=False),
        f"exact chunk, {args.rows} rows, {args.chunk} tokens": lambda: _mels(flow, voices, streaming=True),
    }
    for label, call in calls.items():
        report[label] = _compare(flow, call, device, args.rounds)
        print(label, json.dumps(report[label]), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))


def _row(flow: Flow, prompt: int, tokens: int, gen: torch.Generator, device: torch.device) -> FlowRow:
    vocab, ratio = flow.cfg.vocab_size, flow.token_mel_ratio
    return FlowRow(
        torch.randint(0, vocab, (tokens,), generator=gen).to(device),
        torch.randint(0, vocab, (prompt,), generator=gen).to(device),
        torch.randn(ratio * prompt, flow.cfg.output_size, generator=gen).to(device),
        torch.randn(flow.cfg.spk_embed_dim, generator=gen).to(device),
        0,
    )


def _mels(flow: Flow, rows: list[FlowRow], streaming: bool) -> list[torch.Tensor]:
    return [mel.cpu() for mel in infer_rows(flow, rows, streaming=streaming, finalize=True)]


def _compare(
    flow: Flow, call: Callable[[], list[torch.Tensor]], device: torch.device, rounds: int
) -> dict[str, Any]:
    captures = {"eager": None, "graphed": CudaStepCapture(device)}
    peaks: dict[str, int] = {}

    def variant(name: str) -> Callable[[], list[torch.Tensor]]:
        def run() -> list[torch.Tensor]:
            flow.cfm.step_capture = captures[name]
            torch.cuda.reset_peak_memory_stats(device)
            mels = call()
            peaks[name] = torch.cuda.max_memory_allocated(device)
            return mels

        return run

    medians, outputs = interleaved({name: variant(name) for name in captures}, rounds, 1)
    flow.cfm.step_capture = None
    pairs = zip(outputs["eager"], outputs["graphed"], strict=True)
    diff = max((a - b).abs().max().item() for a, b in pairs)
    return {
        "eager_ms": medians["eager"],
        "graphed_ms": medians["graphed"],
        "peak_mib": {name: peak / 2**20 for name, peak in peaks.items()},
        "max_abs_diff": diff,
    }


if __name__ == "__main__":
    main()
