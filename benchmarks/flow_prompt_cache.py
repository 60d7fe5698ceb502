"""First-chunk flow time of a stream with and without its voice's primed prompt
(``Flow.prime_stream``, what ``EngineConfig.flow_prompt_cache_mb`` keeps per voice).

    python benchmarks/flow_prompt_cache.py --model-dir /tmp/cv2-full --threads 1

Without ``--model-dir`` a random flow of ``--size`` (default full). A ``--prompt``-token
voice prompt, then the first chunk of a stream (prompt + first hop padded to a block
boundary as upstream, or ``--first-hop`` tokens) through ``Flow.stream``, ``--repeats``
times each: from an empty cache ("cold"), and from a fork of the primed cache ("primed").
Priming itself (once per voice, a cache miss) is timed too, and the first chunk from a
fork of the voice primed whole (``Flow.prime_stream``'s ``whole``: its last block's
look-ahead past the prompt read as zeros; "whole"). Prints wall and CPU seconds (CPU: all
threads of the process, steadier on a shared machine) per run, their medians, the primed
prefixes and their memory, and max |mel difference| between the cold and primed first
chunks.

Then what priming whole changes in the audio: a stream of ``--stream-tokens`` tokens from
each primed cache, chunk by chunk, as max and mean |mel difference| per chunk, and at each
seam between chunks the change in the jump from the last frame of one chunk to the first
of the next (how much the whole-primed stream's seams differ from the exact stream's).
"""

import argparse
import itertools
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from flow_streaming import load_flow  # benchmarks/ is on the path when run as a script

from cosyserve.engine.chunking import ChunkSchedule
from cosyserve.modeldir.presets import PRESETS
from cosyserve.models.flow.flow import Flow
from cosyserve.models.flow.stream_cache import FlowStreamCache


def timed(call: Callable[[], object]) -> tuple[float, float]:
    """Wall and CPU seconds of ``call()``."""
    wall, cpu = time.perf_counter(), time.process_time()
    call()
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", type=Path, help="load flow.pt from this model directory")
    parser.add_argument("--size", choices=sorted(PRESETS), default="full", help="random flow geometry")
    parser.add_argument("--prompt", type=int, default=75, help="prompt speech tokens (75: 3 s)")
    parser.add_argument("--first-hop", type=int, help="first chunk's new tokens (default: upstream's)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--stream-tokens", type=int, default=150, help="tokens of the compared streams")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    flow: Flow = load_flow(args.model_dir, args.size, args.seed)
    gen = torch.Generator().manual_seed(args.seed + 1)
    vocab = flow.cfg.vocab_size
    prompt_token = torch.randint(0, vocab, (1, args.prompt), generator=gen)
    prompt_feat = torch.randn(1, 2 * args.prompt, flow.cfg.output_size, generator=gen)
    embedding = torch.randn(1, flow.cfg.spk_embed_dim, generator=gen)
    chunk = chunk_schedule(flow, args).next_chunk(10**6, finished=False)
    assert chunk is not None
    tokens = torch.randint(0, vocab, (1, chunk.token_end), generator=gen)
    voice = (prompt_token, prompt_feat, embedding)

    def first_chunk(cache: FlowStreamCache) -> torch.Tensor:
        return flow.stream(cache, tokens, *voice, chunk.offset, chunk.finalize)

    primed = flow.prime_stream(*voice)  # a warm-up as well
    whole = flow.prime_stream(*voice, whole=True)
    mels = {"cold": first_chunk(flow.new_stream_cache()), "primed": first_chunk(primed.fork())}
    runs: dict[str, list[tuple[float, float]]] = {"cold": [], "prime": [], "primed": [], "whole": []}
    print(
        f"prompt {args.prompt} tokens, first chunk {chunk.token_end} tokens; "
        f"primed prefix {primed.tokens} tokens, {primed.nbytes() / 2**20:.1f} MiB; "
        f"whole {whole.tokens} tokens, {whole.nbytes() / 2**20:.1f} MiB",
        flush=True,
    )
    print("run  kind     wall_s   cpu_s  load1", flush=True)
    for i in range(args.repeats):
        for kind, call in (
            ("cold", lambda: first_chunk(flow.new_stream_cache())),
            ("prime", lambda: flow.prime_stream(*voice)),
            ("primed", lambda: first_chunk(primed.fork())),
            ("whole", lambda: first_chunk(whole.fork())),
        ):
            load = os.getloadavg()[0]
            wall, cpu = timed(call)
            runs[kind].append((wall, cpu))
            print(f"{i + 1:>3}  {kind:<7} {wall:>7.3f} {cpu:>7.2f} {load:>6.2f}", flush=True)

    summary = {
        kind: {
            "median_wall_s": statistics.median(w for w, _ in rows),
            "median_cpu_s": statistics.median(c for _, c in rows),
        }
        for kind, rows in runs.items()
    }
    diff = float((mels["cold"] - mels["primed"]).abs().max())
    for kind, row in summary.items():
        print(f"median {kind:<7} {row['median_wall_s']:>7.3f} {row['median_cpu_s']:>7.2f}")
    cold, warm = summary["cold"]["median_cpu_s"], summary["primed"]["median_cpu_s"]
    print(f"first chunk CPU primed/cold: {warm / cold:.2f}; max |mel difference| {diff:.2e}")
    deviation = whole_deviation(flow, voice, (primed, whole), args, gen)
    print(json.dumps(deviation, indent=2), flush=True)
    if args.json:
        result = {
            "whole_tokens": whole.tokens,
            "whole_bytes": whole.nbytes(),
            "whole_deviation": deviation,
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "first_chunk_tokens": chunk.token_end,
            "primed_tokens": primed.tokens,
            "primed_bytes": primed.nbytes(),
            "runs": runs,
            "summary": summary,
            "max_abs_mel_diff": diff,
        }
        args.json.write_text(json.dumps(result, indent=2))


def chunk_schedule(flow: Flow, args: argparse.Namespace) -> ChunkSchedule:
    """A stream's chunks after the ``--prompt``-token prompt, the first of ``--first-hop``."""
    return ChunkSchedule(
        args.prompt,
        hop=flow.cfg.encoder.static_chunk_size,
        lookahead=flow.cfg.pre_lookahead_len,
        first_hop=args.first_hop,
    )


def whole_deviation(
    flow: Flow,
    voice: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    caches: tuple[FlowStreamCache, FlowStreamCache],
    args: argparse.Namespace,
    gen: torch.Generator,
) -> dict[str, object]:
    """A stream from each primed cache (exact, whole), chunk by chunk: per chunk max and
    mean |mel difference|, per seam |change of the jump across it|, the exact stream's std."""
    tokens = torch.randint(0, flow.cfg.vocab_size, (1, args.stream_tokens), generator=gen)
    streams: list[list[torch.Tensor]] = [[], []]
    for primed, chunks in zip(caches, streams, strict=True):
        cache, schedule = primed.fork(), chunk_schedule(flow, args)
        for available in range(1, args.stream_tokens + 1):
            step = schedule.next_chunk(available, finished=available == args.stream_tokens)
            if step is not None:
                mel = flow.stream(cache, tokens[:, : step.token_end], *voice, step.offset, step.finalize)
                chunks.append(mel)
    exact, whole = streams
    jumps = [
        [float((b[:, :, 0] - a[:, :, -1]).abs().max()) for a, b in itertools.pairwise(chunks)]
        for chunks in streams
    ]
    return {
        "chunk_frames": [int(m.shape[2]) for m in exact],
        "max_abs": [float((a - b).abs().max()) for a, b in zip(whole, exact, strict=True)],
        "mean_abs": [float((a - b).abs().mean()) for a, b in zip(whole, exact, strict=True)],
        "seam_jump_change": [abs(w - e) for w, e in zip(jumps[1], jumps[0], strict=True)],
        "seam_jump_exact": jumps[0],
        "exact_std": float(torch.cat(exact, dim=2).std()),
    }


if __name__ == "__main__":
    main()
