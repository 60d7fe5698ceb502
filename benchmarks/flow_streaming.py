"""Per-chunk flow time of streaming synthesis: upstream's full recompute ("exact") against
the incremental flow cache ("incremental"), with the mel deviation between them.

    python benchmarks/flow_streaming.py --model-dir /tmp/cv2-full     # after
    cosyserve model init /tmp/cv2-full --size full
    python benchmarks/flow_streaming.py                                  # random full flow, no files

Streams ``--chunks`` intermediate chunks of ``--hop`` tokens (plus the 3 lookahead tokens)
after a ``--prompt``-token voice prompt, then a final chunk of ``--final`` tokens, through
both paths. Prints one row per chunk: flow seconds in each mode, the 1-minute load
average when the chunk ran (the machine may be shared: compare rows with similar load),
and max |mel difference| between the modes. The final chunk of the exact path uses full
attention as upstream; the incremental path's is block-causal (``flow_cache="incremental"``),
and ``flow_cache="cached"`` would take the exact final chunk instead. Seams: mean |mel
jump| from the last frame of one chunk to the first of the next, against the median
frame-to-frame change inside chunks.
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

from cosyserve.modeldir.layout import ModelDir
from cosyserve.modeldir.presets import PRESETS
from cosyserve.models.flow.flow import Flow, flow_checkpoint_table
from cosyserve.pipeline.chunking import Chunk, ChunkSchedule
from cosyserve.weights.checkpoint import load_checkpoint
from cosyserve.weights.randomize import randomize_


def load_flow(model_dir: Path | None, size: str, seed: int) -> Flow:
    if model_dir is not None:
        root = ModelDir.open(model_dir)
        hp = root.hparams()
        flow = Flow(hp.flow)
        load_checkpoint(flow, root.flow, flow_checkpoint_table(hp.flow))
    else:
        flow = Flow(PRESETS[size].flow)
        randomize_(flow, torch.Generator().manual_seed(seed))
    return flow.eval().requires_grad_(False)


def schedule(flow: Flow, prompt: int, total: int) -> list[Chunk]:
    cursor = ChunkSchedule(
        prompt, hop=flow.cfg.encoder.static_chunk_size, lookahead=flow.cfg.pre_lookahead_len
    )
    chunks = []
    while (chunk := cursor.next_chunk(total, finished=True)) is not None:
        chunks.append(chunk)
    return chunks


def run_mode(
    chunks: list[Chunk], call: Callable[[Chunk], torch.Tensor]
) -> tuple[list[torch.Tensor], list[tuple[float, float, float]]]:
    """Mel per chunk and (wall s, CPU s of all threads, 1-min load average) per chunk."""
    mels, times = [], []
    for chunk in chunks:
        load = os.getloadavg()[0]
        wall, cpu = time.perf_counter(), time.process_time()
        mels.append(call(chunk))
        times.append((time.perf_counter() - wall, time.process_time() - cpu, load))
    return mels, times


def seams(mels: list[torch.Tensor]) -> list[float]:
    """Mean |mel jump| across each chunk boundary (index i: between chunk i and i+1)."""
    return [
        float((b[0, :, 0] - a[0, :, -1]).abs().mean())
        for a, b in itertools.pairwise(mels)
        if a.shape[2] and b.shape[2]
    ]


def inner_step(mels: list[torch.Tensor]) -> float:
    steps = [float(d) for m in mels for d in m[0].diff(dim=1).abs().mean(dim=0)]
    return statistics.median(steps)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", type=Path, help="load flow.pt from this model directory")
    parser.add_argument("--size", choices=sorted(PRESETS), default="full", help="random flow geometry")
    parser.add_argument("--prompt", type=int, default=75, help="prompt speech tokens")
    parser.add_argument("--chunks", type=int, default=12, help="intermediate chunks")
    parser.add_argument("--final", type=int, default=15, help="tokens of the final chunk")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    flow = load_flow(args.model_dir, args.size, args.seed)
    hop, lookahead = flow.cfg.encoder.static_chunk_size, flow.cfg.pre_lookahead_len
    gen = torch.Generator().manual_seed(args.seed + 1)
    vocab = flow.cfg.vocab_size
    total = args.chunks * hop + max(args.final, lookahead) + (-args.prompt % hop)
    tokens = torch.randint(0, vocab, (1, total), generator=gen)
    prompt_token = torch.randint(0, vocab, (1, args.prompt), generator=gen)
    prompt_feat = torch.randn(1, 2 * args.prompt, flow.cfg.output_size, generator=gen)
    embedding = torch.randn(1, flow.cfg.spk_embed_dim, generator=gen)
    chunks = schedule(flow, args.prompt, total)
    ratio = flow.token_mel_ratio

    def exact(chunk: Chunk) -> torch.Tensor:
        mel = flow.inference(
            tokens[:, : chunk.token_end],
            prompt_token,
            prompt_feat,
            embedding,
            streaming=not chunk.finalize,
            finalize=chunk.finalize,
        )
        return mel[:, :, ratio * chunk.offset :]

    cache = flow.new_stream_cache()
    cache_bytes: list[int] = []

    def incremental(chunk: Chunk) -> torch.Tensor:
        part = tokens[:, : chunk.token_end]
        mel = flow.stream(cache, part, prompt_token, prompt_feat, embedding, chunk.offset, chunk.finalize)
        cache_bytes.append(cache.nbytes())
        return mel

    print(f"threads {torch.get_num_threads()}, prompt {args.prompt} tokens, {len(chunks)} chunks")
    inc_mel, inc_t = run_mode(chunks, incremental)
    exact_mel, exact_t = run_mode(chunks, exact)
    # Upstream's own streaming-vs-offline gap, for scale: the same frames without streaming.
    offline = flow.inference(tokens, prompt_token, prompt_feat, embedding, streaming=False, finalize=True)
    streamed = torch.cat(exact_mel, dim=2)

    rows = []
    print(
        "chunk tokens frames | exact: wall_s  cpu_s load | incremental: wall_s  cpu_s load |"
        " max|dmel| cache_MB"
    )
    for i, chunk in enumerate(chunks):
        diff = float((exact_mel[i] - inc_mel[i]).abs().max()) if exact_mel[i].numel() else 0.0
        (e_wall, e_cpu, e_load), (i_wall, i_cpu, i_load) = exact_t[i], inc_t[i]
        row = {
            "chunk": i + 1,
            "final": chunk.finalize,
            "token_end": chunk.token_end,
            "frames": int(inc_mel[i].shape[2]),
            "exact_wall_s": e_wall,
            "exact_cpu_s": e_cpu,
            "exact_load1": e_load,
            "incremental_wall_s": i_wall,
            "incremental_cpu_s": i_cpu,
            "incremental_load1": i_load,
            "max_abs_mel_diff": diff,
            "cache_mb": cache_bytes[i] / 2**20,
        }
        rows.append(row)
        print(
            f"{i + 1:>5}{'F' if chunk.finalize else ' '} {chunk.token_end:>5} {row['frames']:>6} |"
            f" {e_wall:>12.3f} {e_cpu:>6.2f} {e_load:>4.1f} | {i_wall:>18.3f} {i_cpu:>6.2f} {i_load:>4.1f} |"
            f" {diff:>9.2e} {row['cache_mb']:>8.1f}"
        )
    summary = {
        "incremental_10th_over_2nd_wall": inc_t[9][0] / inc_t[1][0] if len(chunks) > 10 else None,
        "incremental_10th_over_2nd_cpu": inc_t[9][1] / inc_t[1][1] if len(chunks) > 10 else None,
        "exact_10th_over_2nd_wall": exact_t[9][0] / exact_t[1][0] if len(chunks) > 10 else None,
        "exact_10th_over_2nd_cpu": exact_t[9][1] / exact_t[1][1] if len(chunks) > 10 else None,
        "flow_wall_s_exact_total": sum(t[0] for t in exact_t),
        "flow_wall_s_incremental_total": sum(t[0] for t in inc_t),
        "max_abs_mel_diff_intermediate": max(r["max_abs_mel_diff"] for r in rows if not r["final"]),
        "max_abs_mel_diff_final": rows[-1]["max_abs_mel_diff"],
        "mean_abs_mel_diff_final": float((exact_mel[-1] - inc_mel[-1]).abs().mean()),
        "mean_abs_mel": float(streamed.abs().mean()),
        "offline_vs_stream_max_abs_diff": float((offline - streamed).abs().max()),
        "offline_vs_stream_mean_abs_diff": float((offline - streamed).abs().mean()),
        "final_seam_exact": seams(exact_mel)[-1],
        "final_seam_incremental": seams(inc_mel)[-1],
        "intermediate_seams_mean": statistics.mean(seams(exact_mel)[:-1]),
        "inner_frame_step_median": inner_step(exact_mel),
    }
    for key, value in summary.items():
        print(f"{key}: {value if value is None else f'{value:.4g}'}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {"args": vars(args) | {"model_dir": str(args.model_dir)}, "rows": rows, "summary": summary},
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
