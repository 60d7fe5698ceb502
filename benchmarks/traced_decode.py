"""Decode steps replayed from the engine's TorchScript traces against eager steps, on a
full-size model: what tracing costs at start and what it saves per step.

    python benchmarks/traced_decode.py --model-dir /tmp/cv2-full-bench [--dtype bf16]
        [--quantize int8] [--max-active 16] [--rounds 15] [--json out.json]

The LM is loaded as the server loads it, with a KV cache as the engine's (``--max-active``
slots of 2048 positions). The script times the capture of the engine's traces
(``DecodeGraphs.for_engine`` with ``TraceCapture``: one trace for a lone row, one for
larger batches) and reads the process's resident memory before and after it. With 8
prompts of 100 to 149 positions prefilled after that, a decode step at batch 1 and at
batch 8, eager and replayed, take turns for ``--rounds`` rounds, each step undone after
it; the first 3 rounds are not counted, and the median milliseconds are printed with the
largest log-prob difference between the two (0.0 where the replay gives the eager step's
bits). Everything runs on a thread of its own with the process's torch threads, as the
engine does.
"""

import json
import time
from functools import partial
from typing import Any

import torch
from bench_args import model_parser  # benchmarks/ is on the path when run as a script
from interleave import interleaved

from cosyserve.engine.decode_graphs import DecodeGraphs, TraceCapture
from cosyserve.engine.loader import LoadedModel, load_model
from cosyserve.models.kv_cache import KVCache
from cosyserve.models.lm import CosyVoice2LM
from cosyserve.parallelism import call_on_own_thread, hand_over_threads
from cosyserve.server.observability.watchdog import read_rss_bytes

MAX_LEN = 2048
PROMPTS = 8
WARM_UP = 3


def main() -> None:
    parser = model_parser(__doc__)
    parser.add_argument("--max-active", type=int, default=16, help="the engine's max_active")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    threads = hand_over_threads()
    model = load_model(args.model_dir, dtype=args.dtype, quantize=args.quantize, threads=threads)
    run = partial(measure, model, args.max_active, args.rounds)
    report = call_on_own_thread(run, threads=threads, name="bench")
    report["precision"] = model.precision.describe()
    print(json.dumps(report, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))


@torch.inference_mode()
def measure(model: LoadedModel, max_active: int, rounds: int) -> dict[str, Any]:
    lm = model.lm
    cache = KVCache.for_config(lm.cfg.qwen, max_active, MAX_LEN, model.precision.kv_cache_dtype)
    # Captured first, as the engine does at start: the capture borrows a free slot.
    before = read_rss_bytes() / 2**20
    start = time.perf_counter()
    graphs = DecodeGraphs.for_engine(lm, cache, TraceCapture(lm), max_active)
    report: dict[str, Any] = {
        "capture_s": time.perf_counter() - start,
        "traces": len(graphs.replays),
        "rss_before_capture_mib": before,
        "rss_after_capture_mib": read_rss_bytes() / 2**20,
    }
    gen = torch.Generator().manual_seed(0)
    slots = prefilled_slots(lm, cache, gen)
    for batch in (1, PROMPTS):
        active = slots[:batch]
        tokens = torch.randint(0, lm.cfg.speech_token_size, (batch,), generator=gen)
        steps = {
            "eager": partial(lm.decode, tokens, active, cache),
            "traced": partial(graphs.decode, tokens, active),
        }
        medians, outputs = interleaved(steps, partial(undo_step, cache, active), rounds, WARM_UP)
        report[f"batch_{batch}"] = {
            **{f"{name}_ms": ms for name, ms in medians.items()},
            "max_log_prob_difference": (outputs["eager"] - outputs["traced"]).abs().max().item(),
        }
    report["rss_at_end_mib"] = read_rss_bytes() / 2**20
    return report


def prefilled_slots(lm: CosyVoice2LM, cache: KVCache, gen: torch.Generator) -> list[int]:
    """``PROMPTS`` new slots of ``cache``, prefilled with random speech tokens from ``gen``:
    100, 107, ... 149 positions."""
    slots = []
    for i in range(PROMPTS):
        slots.append(cache.allocate())
        ids = torch.randint(0, lm.cfg.speech_token_size, (100 + 7 * i,), generator=gen)
        lm.prefill(lm.speech_embedding(ids), slots[-1], cache)
    return slots


def undo_step(cache: KVCache, slots: list[int]) -> None:
    """Drop the position a decode step added to ``slots``: every round decodes the same one."""
    for slot in slots:
        cache.truncate(slot, cache.length(slot) - 1)


if __name__ == "__main__":
    main()
