"""Time CosyVoice 3 incremental streaming (``Flow3Stream``) at its 2nd and 8th chunk on the
full ``FULL3`` geometry (random weights), against recomputing the whole prefix as
upstream's ``token2wav`` does.

    OMP_NUM_THREADS=1 python benchmarks/flow3_stream.py [--steps-only]

Chunks follow ``CosyVoice3Model.tts`` with a 25-token prompt: hops of 25, 50, then 100
tokens. A chunk's time does not depend on the cached values, so the cache before chunk
``k`` is filled with random keys/values of the right size instead of running chunks
``1 .. k-1``. Incremental chunks run all 10 Euler steps; the whole-prefix recompute of
chunk 8 (1400 frames) is timed for one Euler step and scaled by 10 (``--steps-only``
times one step of every case).
"""

import argparse
import time

import torch

from cosyserve.modeldir.presets import FULL3
from cosyserve.models.dit import Flow3, Flow3Stream
from cosyserve.models.dit.cache import StepCache

PROMPT = 25
HOPS = [25, 50, 100, 100, 100, 100, 100, 100]
LOOKAHEAD = 3


def synthetic_caches(flow: Flow3, frames: int) -> list[StepCache]:
    dit = flow.cfg.dit
    caches = []
    for _ in range(flow.cfg.cfm.n_timesteps):
        cache = StepCache(dit.depth)
        for layer in range(dit.depth):
            # With room for the chunk, as a grown buffer has.
            cache.keys[layer] = torch.randn(2, dit.heads, frames + 512, dit.dim_head)
            cache.values[layer] = torch.randn(2, dit.heads, frames + 512, dit.dim_head)
        cache.tails = {name: torch.randn(2, dit.dim, 30) for name in ("pos_conv1", "pos_conv2")}
        cache.length = frames
        caches.append(cache)
    return caches


def stream_at(flow: Flow3, chunk: int, tokens: torch.Tensor, prompt: dict[str, torch.Tensor]) -> Flow3Stream:
    """A stream as it stands before chunk ``chunk`` (1-based)."""
    done = sum(HOPS[: chunk - 1])
    stream = Flow3Stream(flow, prompt["token"], prompt["feat"], prompt["embedding"])
    stream.tokens = tokens[:, :done]
    stream.returned = 2 * (PROMPT + done)
    stream.caches = synthetic_caches(flow, 2 * (PROMPT + done))
    return stream


def one_step(flow: Flow3, frames: int, cached: int) -> float:
    """Seconds of one Euler step (both guidance rows) over ``frames`` new frames."""
    cache = synthetic_caches(flow, cached)[0] if cached else None
    x = torch.randn(2, 80, frames)
    t0 = time.perf_counter()
    flow.cfm.estimator(x, x, x, torch.randn(2, 80), torch.full((2,), 0.5), True, cache)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps-only", action="store_true")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    torch.manual_seed(0)
    flow = Flow3(FULL3.flow).eval()
    total = sum(HOPS) + LOOKAHEAD
    tokens = torch.randint(0, 6561, (1, total))
    prompt = {
        "token": tokens[:, :PROMPT],
        "feat": torch.randn(1, 2 * PROMPT, 80),
        "embedding": torch.randn(1, 192),
    }
    print(f"torch threads: {torch.get_num_threads()}")
    for chunk in (2, 8):
        done = sum(HOPS[: chunk - 1])
        new, cached = 2 * HOPS[chunk - 1], 2 * (PROMPT + done)
        step = one_step(flow, new, cached)
        whole = one_step(flow, cached + new, 0)
        line = (
            f"chunk {chunk}: {new} new frames after {cached} cached; one Euler step: "
            f"incremental {step:.2f} s ({1000 * step / new:.1f} ms/frame), "
            f"whole prefix {whole:.2f} s"
        )
        if not args.steps_only:
            stream = stream_at(flow, chunk, tokens, prompt)
            end = done + HOPS[chunk - 1]
            t0 = time.perf_counter()
            mel = stream.push(tokens[:, done:end], tokens[:, end : end + LOOKAHEAD])
            push = time.perf_counter() - t0
            line += f"; push (10 steps) {push:.2f} s -> {tuple(mel.shape)}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
