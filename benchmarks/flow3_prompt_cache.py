"""Time a CosyVoice 3 stream's first flow chunk with and without a primed voice prompt
(:class:`~cosyserve.models.dit.Flow3PromptCache`), one run each:

    OMP_NUM_THREADS=1 python benchmarks/flow3_prompt_cache.py MODEL_DIR [--prompt-s 3] [--first-hop 5]

Unprimed, the first push runs the DiT over every prompt frame and its own; primed exactly
(a cache hit) over the prompt frames after the primed chunks and its own; primed whole
over its own only. Also prints what priming a voice once costs, the memory held and the
first chunk's largest mel difference from unprimed (0 up to rounding when exact).
"""

import argparse
import time
from collections.abc import Callable

import torch
from torch import Tensor

from cosyserve.bench.workload import synthetic_voice
from cosyserve.engine.loader import load_model
from cosyserve.models.dit import Flow3, Flow3PromptCache, Flow3Stream


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("--prompt-s", type=float, default=3.0, help="synthetic prompt seconds")
    parser.add_argument("--first-hop", type=int, default=5, help="tokens of the first chunk")
    args = parser.parse_args()
    start = time.perf_counter()
    model = load_model(args.model_dir)
    flow = model.flow
    if not isinstance(flow, Flow3):
        raise SystemExit("not a CosyVoice 3 model directory")
    print(f"loaded in {time.perf_counter() - start:.1f} s; flow {next(flow.parameters()).dtype}", flush=True)
    voice = synthetic_voice(model.hparams, args.prompt_s, seed=0)
    prompt = (voice.speech_tokens[None], voice.mel[None], voice.embedding[None])
    hop, lookahead = args.first_hop, flow.cfg.pre_lookahead_len
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, flow.cfg.vocab_size, (1, hop + lookahead), generator=gen)

    def first_chunk(make: Callable[[], Flow3Stream]) -> tuple[Tensor, float, float, int]:
        """The first push's mel, seconds to make the stream, seconds in all, primed frames."""
        start = time.perf_counter()
        stream = make()
        made, primed = time.perf_counter(), stream.cached_frames
        mel = stream.push(tokens[:, :hop], tokens[:, hop:])
        return mel, made - start, time.perf_counter() - start, primed

    reference, _, seconds, _ = first_chunk(lambda: Flow3Stream(flow, *prompt))
    frames = voice.mel.shape[0]
    print(f"unprimed: first chunk {seconds:.2f} s ({frames} prompt frames)", flush=True)
    for whole in (False, True):
        cache = Flow3PromptCache(flow, 1 << 40, whole=whole)
        start = time.perf_counter()
        cache.stream(*prompt)  # the miss primes the voice
        priming = time.perf_counter() - start
        mel, fork, seconds, primed = first_chunk(lambda: cache.stream(*prompt))  # noqa: B023
        difference = float((mel - reference).abs().max())
        print(
            f"{'whole' if whole else 'exact'}: priming {priming:.2f} s, {primed} frames, "
            f"{cache.nbytes / 2**20:.0f} MiB held; a hit: fork {fork:.3f} s, first chunk {seconds:.2f} s; "
            f"max |mel - unprimed| {difference:.2e}",
            flush=True,
        )


if __name__ == "__main__":
    main()
