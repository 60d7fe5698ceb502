"""The LM's two attention kernels on a full-size model: what each costs in decode steps and
prefill chunks, and whether a row's output depends on its batch or its prefill split.

    python benchmarks/lm_attention.py --model-dir /tmp/cv2-full-bench [--dtype bf16]
        [--quantize int8] [--repeats 15] [--json out.json]

The LM is loaded as the server loads it. On a CPU, decode steps and prefill chunks run
:func:`~cosyserve.models.span_attention.span_attention` (``runs_span_attention``); each
measurement here runs it and torch's kernel, the choice forced in turn (interleaved within
each repeat), and prints the median milliseconds:

- a decode step at batch 1 and at batch 8 (rows of 100 to 219 positions of random
  tokens), eager and replayed from the engine's traces (``DecodeGraphs`` with
  ``TraceCapture``, recorded with each kernel);
- prefill chunks of 88 positions (a 3 s voice prompt and its text), of 256 from position
  0, and of 256 after 768 cached positions (a third as many repeats).

Then the checks, with the kernels as the engine runs them: a row of 50 positions decoded
alone and in one step with rows of 130 and 700, eager; each of 8 rows decoded alone and
in one step of 8, replayed from each kernel's traces; and a prompt of 88 positions
prefilled whole and in chunks of 40, 1 and 47. Each prints the largest log-prob
difference.
"""

import json
from collections.abc import Callable
from functools import partial
from typing import TypeVar

import torch
from bench_args import model_parser  # benchmarks/ is on the path when run as a script
from interleave import interleaved

import cosyserve.models.qwen2 as qwen2
from cosyserve.engine.decode_graphs import DecodeGraphs, TraceCapture
from cosyserve.engine.loader import load_model
from cosyserve.models.kv_cache import KVCache
from cosyserve.models.lm import CosyVoice2LM

KERNELS = {"torch": False, "span": True}
PROMPTS = 8
ENGINE_CHOICE = qwen2.runs_span_attention
T = TypeVar("T")


def forced(span: bool, run: Callable[[], T]) -> Callable[[], T]:
    """``run`` with the LM's attention kernel forced: ``span_attention`` or torch's."""

    def call() -> T:
        qwen2.runs_span_attention = lambda device: span
        return run()

    return call


def kernel_times(
    run: Callable[[], object], undo: Callable[[], None], rounds: int, warm_up: int
) -> dict[str, float]:
    """Median ms of ``run()`` per kernel, interleaved (:func:`interleave.interleaved`)."""
    variants = {name: forced(span, run) for name, span in KERNELS.items()}
    return interleaved(variants, undo, rounds, warm_up)[0]


def decode_rows(cache: KVCache, batch: int) -> tuple[list[int], torch.Tensor, Callable[[], None]]:
    """The first ``batch`` slots, a token for each, and a call that truncates the slots back
    to their lengths now (undoing the steps timed on them)."""
    slots = list(range(batch))
    lengths = [cache.length(s) for s in slots]

    def undo() -> None:
        for slot, length in zip(slots, lengths, strict=True):
            cache.truncate(slot, length)

    return slots, torch.arange(batch) + 3, undo


def decode_times(lm: CosyVoice2LM, cache: KVCache, batch: int, repeats: int) -> dict[str, float]:
    """Median ms of a decode step of ``batch`` rows per kernel; the slots are left as found."""
    slots, tokens, undo = decode_rows(cache, batch)
    return kernel_times(lambda: lm.decode(tokens, slots, cache), undo, repeats + 2, warm_up=2)


def traces(lm: CosyVoice2LM, cache: KVCache) -> dict[str, DecodeGraphs]:
    """The engine's traced decode steps, recorded with each kernel (before any slot is
    taken: the capture borrows a free one)."""

    def capture() -> DecodeGraphs:
        return DecodeGraphs.for_engine(lm, cache, TraceCapture(lm), PROMPTS)

    graphs = {name: forced(span, capture)() for name, span in KERNELS.items()}
    qwen2.runs_span_attention = ENGINE_CHOICE
    return graphs


def traced_decode_times(
    graphs: dict[str, DecodeGraphs], cache: KVCache, batch: int, repeats: int
) -> dict[str, float]:
    """Median ms of a replayed decode step of ``batch`` rows per kernel's traces."""
    slots, tokens, undo = decode_rows(cache, batch)
    steps = {name: partial(g.decode, tokens, slots) for name, g in graphs.items()}
    return interleaved(steps, undo, repeats + 2, 2)[0]


def traced_alone_and_batched(graphs: dict[str, DecodeGraphs], cache: KVCache) -> dict[str, float]:
    """Per kernel's traces, the largest |log-prob difference| of each of the first 8 rows
    decoded alone and in one step of 8; the slots are left as found."""
    slots, tokens = list(range(PROMPTS)), torch.arange(PROMPTS) + 11
    result = {}
    for name, g in graphs.items():
        together = g.decode(tokens, slots).clone()
        alone = []
        for i, slot in enumerate(slots):
            cache.truncate(slot, cache.length(slot) - 1)
            alone.append(g.decode(tokens[i : i + 1], [slot])[0].clone())
        for slot in slots:
            cache.truncate(slot, cache.length(slot) - 1)
        result[name] = max(float((together[i] - row).abs().max()) for i, row in enumerate(alone))
    return result


def prefill_times(lm: CosyVoice2LM, cache: KVCache, start: int, n: int, repeats: int) -> dict[str, float]:
    """Median ms of prefilling positions ``[start, start + n)`` of slot 8 per kernel."""
    embeddings = lm.speech_embedding(torch.arange(start + n) % 500)
    slot = 8
    cache.truncate(slot, 0)
    if start:
        lm.prefill(embeddings[:start], slot, cache)
    return kernel_times(
        lambda: lm.prefill(embeddings[start:], slot, cache),
        lambda: cache.truncate(slot, start),
        max(3, repeats // 3) + 1,
        warm_up=1,
    )


def checks(lm: CosyVoice2LM, cache: KVCache) -> dict[str, float]:
    """Largest |log-prob difference| of a row alone and batched, and of a prompt whole and
    split, with the kernels as the engine runs them."""
    qwen2.runs_span_attention = ENGINE_CHOICE
    for slot in range(9):
        cache.truncate(slot, 0)
    lengths = (50, 130, 700)
    for slot, length in enumerate(lengths):
        lm.prefill(lm.speech_embedding(torch.arange(length) % 300), slot, cache)
    tokens = torch.tensor([5, 7, 9])
    alone = []
    for slot, length in enumerate(lengths):
        alone.append(lm.decode(tokens[slot : slot + 1], [slot], cache)[0])
        cache.truncate(slot, length)
    together = lm.decode(tokens, [0, 1, 2], cache)
    decode = max(float((together[i] - alone[i]).abs().max()) for i in range(3))
    prompt = lm.speech_embedding(torch.arange(88) % 300)
    for slot in (3, 4):
        cache.truncate(slot, 0)
    whole = lm.prefill(prompt, 3, cache)
    for begin, end in ((0, 40), (40, 41), (41, 88)):
        split = lm.prefill(prompt[begin:end], 4, cache)
    return {"decode_beside_longer_rows": decode, "prefill_split": float((split - whole).abs().max())}


def main() -> None:
    parser = model_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    model = load_model(args.model_dir, dtype=args.dtype, quantize=args.quantize)
    lm = model.lm
    cache = KVCache.for_config(lm.cfg.qwen, PROMPTS + 1, 2048, model.precision.kv_cache_dtype)
    results: dict[str, object] = {"precision": model.precision.describe()}
    with torch.inference_mode():
        graphs = traces(lm, cache)
        for _ in range(PROMPTS + 1):
            cache.allocate()
        gen = torch.Generator().manual_seed(0)
        for slot in range(PROMPTS):
            ids = torch.randint(0, lm.cfg.speech_token_size, (100 + 17 * slot,), generator=gen)
            lm.prefill(lm.speech_embedding(ids), slot, cache)
        for batch in (1, PROMPTS):
            results[f"decode_batch_{batch}_ms"] = decode_times(lm, cache, batch, args.repeats)
            print(f"decode step, batch {batch}:", results[f"decode_batch_{batch}_ms"])
            results[f"traced_decode_batch_{batch}_ms"] = traced_decode_times(
                graphs, cache, batch, args.repeats
            )
            print(f"traced decode step, batch {batch}:", results[f"traced_decode_batch_{batch}_ms"])
        results["traced_alone_vs_batched_max_abs_log_prob_difference"] = traced_alone_and_batched(
            graphs, cache
        )
        print(
            "traced, alone against batched:", results["traced_alone_vs_batched_max_abs_log_prob_difference"]
        )
        for start, n in ((0, 88), (0, 256), (768, 256)):
            key = f"prefill_{n}_after_{start}_ms"
            results[key] = prefill_times(lm, cache, start, n, args.repeats)
            print(f"prefill of {n} after {start}:", results[key])
        results["max_abs_log_prob_difference"] = checks(lm, cache)
        print("max |log-prob difference|:", results["max_abs_log_prob_difference"])
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
