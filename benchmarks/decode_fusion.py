"""LM decode steps with the int8 decoder layers' projections stacked (what ``quantize="int8"``
loads) against torch's quantization of the separate Linears, alternating in one process.

    .venv/bin/python benchmarks/decode_fusion.py --model-dir /tmp/cv2-full-bench [--rounds 3]

Per batch size (1 and 8 sequences of 100 prompt positions) and round, prints the median
of 40 decode steps for each arrangement. Both run on a thread of their own with the
process's torch threads, as the engine does (see ``cosyserve.parallelism``).
"""

import argparse
import statistics
import time
from functools import partial
from pathlib import Path

import torch
from torch import nn

from cosyserve.accel.quantize import ao_quantize_dynamic
from cosyserve.engine.loader import load_model
from cosyserve.models.kv_cache import KVCache
from cosyserve.models.lm import CosyVoice2LM
from cosyserve.parallelism import call_on_own_thread, hand_over_threads

STEPS = 40
PROMPT = 100


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    threads = hand_over_threads()
    stacked = load_model(args.model_dir, quantize="int8", threads=threads).lm
    separate = load_model(args.model_dir, threads=threads).lm
    quantize_dynamic = ao_quantize_dynamic()
    if quantize_dynamic is None:
        raise SystemExit("this torch has no torch.ao dynamic quantization")
    qconfig = torch.ao.quantization.per_channel_dynamic_qconfig
    call_on_own_thread(
        lambda: quantize_dynamic(separate.qwen.layers, {nn.Linear: qconfig}, dtype=torch.qint8, inplace=True),
        threads=threads,
        name="quantize",
    )
    for batch in (1, 8):
        for round_ in range(args.rounds):
            for name, lm in (("stacked", stacked), ("separate", separate)):
                ms = call_on_own_thread(partial(_median_step_ms, lm, batch), threads=threads, name="decode")
                print(f"batch {batch}, round {round_}: {name:>8} {ms:6.2f} ms/step", flush=True)


@torch.inference_mode()
def _median_step_ms(lm: CosyVoice2LM, batch: int) -> float:
    gen = torch.Generator().manual_seed(0)
    cache = KVCache.for_config(lm.cfg.qwen, batch, PROMPT + STEPS + 1, torch.float32)
    slots = [cache.allocate() for _ in range(batch)]
    for slot in slots:
        lm.prefill(
            lm.speech_embedding(torch.randint(0, lm.cfg.speech_token_size, (PROMPT,), generator=gen)),
            slot,
            cache,
        )
    tokens = torch.randint(0, lm.cfg.speech_token_size, (batch,), generator=gen)
    times = []
    for _ in range(STEPS):
        start = time.perf_counter()
        lm.decode(tokens, slots, cache)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


if __name__ == "__main__":
    main()
