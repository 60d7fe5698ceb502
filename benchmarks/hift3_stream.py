"""Time the CosyVoice 3 vocoder's stateful stream (``CausalHiFTStream``) at its 2nd and 10th
chunk of 50 mel frames on the full ``FULL3`` geometry (random weights), against re-running
the vocoder over all accumulated mel as upstream's ``CosyVoice3Model.token2wav`` does.

    OMP_NUM_THREADS=1 python benchmarks/hift3_stream.py [--chunks 10] [--repeats 3]

Each push of the stream is timed in ``--repeats`` fresh streams (the median is reported);
the re-decode (``inference(all mel, finalize=False)``) is timed once at the same chunks.
"""

import argparse
import statistics
import time

import torch

from cosyserve.modeldir.presets import FULL3
from cosyserve.models.hift3 import CausalHiFTGenerator, CausalHiFTStream
from cosyserve.weights.randomize import randomize_

CHUNK_FRAMES = 50


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--chunks", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    hift = CausalHiFTGenerator(FULL3.hift).eval()
    randomize_(hift, torch.Generator().manual_seed(0))
    mel = torch.randn(1, 80, CHUNK_FRAMES * args.chunks, generator=torch.Generator().manual_seed(1))
    pushes: list[list[float]] = [[] for _ in range(args.chunks)]
    for _ in range(args.repeats):
        stream = CausalHiFTStream(hift)
        for k in range(args.chunks):
            chunk = mel[:, :, k * CHUNK_FRAMES : (k + 1) * CHUNK_FRAMES]
            start = time.perf_counter()
            stream.push(chunk, finalize=k == args.chunks - 1)
            pushes[k].append(time.perf_counter() - start)
    print(f"threads {torch.get_num_threads()}, {CHUNK_FRAMES} mel frames per chunk, median of {args.repeats}")
    for k, times in enumerate(pushes, start=1):
        print(f"stream push, chunk {k:2d}: {statistics.median(times) * 1e3:8.1f} ms")
    second, last = statistics.median(pushes[1]), statistics.median(pushes[-1])
    print(f"chunk {args.chunks} / chunk 2: {last / second:.2f}")
    for k in (2, args.chunks):
        start = time.perf_counter()
        hift.inference(mel[:, :, : k * CHUNK_FRAMES], finalize=k == args.chunks)
        print(f"re-decode of all mel at chunk {k:2d}: {(time.perf_counter() - start) * 1e3:8.1f} ms")


if __name__ == "__main__":
    main()
