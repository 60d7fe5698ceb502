"""Per-chunk flow time of streaming synthesis: upstream's full recompute ("exact") against
the incremental flow cache ("incremental"), and the mel deviation between the two.

    cosyserve model init /tmp/cv2-full --size full      # once (or leave out --model-dir:
    python benchmarks/flow_streaming.py --model-dir /tmp/cv2-full   # a random full flow)

Streams ``--chunks`` intermediate chunks of 25 tokens (plus the 3 lookahead tokens) after
a ``--prompt``-token voice prompt, then a final chunk of ``--final`` tokens, through both
paths (``--skip-exact``: the incremental one only). Prints a row per chunk as it ends:
wall and CPU seconds (CPU: all threads of the process, steadier than wall time on a
shared machine), the kernel's seconds and the page faults (``sys_s``, ``faults``), the
1-minute load average when the chunk started, and the cache size. ``--reserve`` reserves
the cache for the whole stream as the engine does on CPU; ``--repeat N`` runs N
incremental streams one after another (the later ones reuse the memory the first freed,
which the process keeps, as the engine's does).
Then max |mel difference| per chunk and a summary. The exact final chunk uses full
attention as upstream (what ``flow_cache="cached"`` also runs); the incremental one is
block-causal (``flow_cache="incremental"``). For scale: upstream's own gap between the
streamed frames and the same frames synthesised offline. Seams: mean |mel jump| from
the last frame of one chunk to the first of the next, against the median frame-to-frame
change inside chunks.
"""

import argparse
import itertools
import json
import os
import resource
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from cosyserve.engine.chunking import Chunk, ChunkSchedule
from cosyserve.memory import retain_freed_memory
from cosyserve.modeldir.layout import ModelDir
from cosyserve.modeldir.presets import PRESETS
from cosyserve.models.flow.flow import Flow, flow_checkpoint_table
from cosyserve.models.flow.stream_cache import FlowStreamCache
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
    name: str,
    chunks: list[Chunk],
    call: Callable[[Chunk], torch.Tensor],
    cache: FlowStreamCache | None = None,
) -> tuple[list[torch.Tensor], list[dict[str, float]]]:
    """Mel per chunk and a row of timings per chunk, printed as each chunk ends."""
    print(f"{name}: chunk tokens frames   wall_s  cpu_s  sys_s  faults  load1  cache_MB", flush=True)
    mels, rows = [], []
    for i, chunk in enumerate(chunks):
        load = os.getloadavg()[0]
        usage = resource.getrusage(resource.RUSAGE_SELF)
        wall, cpu = time.perf_counter(), time.process_time()
        mels.append(call(chunk))
        after = resource.getrusage(resource.RUSAGE_SELF)
        row = {
            "chunk": i + 1,
            "token_end": chunk.token_end,
            "frames": mels[-1].shape[2],
            "wall_s": time.perf_counter() - wall,
            "cpu_s": time.process_time() - cpu,
            "sys_s": after.ru_stime - usage.ru_stime,  # the kernel's part: mostly page faults
            "page_faults": after.ru_minflt - usage.ru_minflt,
            "load1": load,
            "cache_mb": 0.0 if cache is None else cache.nbytes() / 2**20,
        }
        rows.append(row)
        final = "F" if chunk.finalize else " "
        print(
            f"{' ' * len(name)}  {i + 1:>4}{final} {chunk.token_end:>6} {row['frames']:>6}"
            f" {row['wall_s']:>8.3f} {row['cpu_s']:>6.2f} {row['sys_s']:>6.2f} {row['page_faults']:>7}"
            f" {load:>6.2f} {row['cache_mb']:>9.1f}",
            flush=True,
        )
    return mels, rows


def ratio_10_2(rows: list[dict[str, float]], key: str) -> float | None:
    return rows[9][key] / rows[1][key] if len(rows) > 10 else None


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
    parser.add_argument("--skip-exact", action="store_true", help="time the incremental path only")
    parser.add_argument(
        "--reserve",
        action="store_true",
        help="reserve the stream's cache for all its tokens (as the engine on CPU)",
    )
    parser.add_argument("--repeat", type=int, default=1, help="incremental streams, one after another")
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    retain_freed_memory()  # as the engine does

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

    def incremental_stream(label: str) -> tuple[list[torch.Tensor], list[dict[str, float]]]:
        cache = flow.new_stream_cache()
        if args.reserve:
            cache.reserve(args.prompt + total, ratio)

        def incremental(chunk: Chunk) -> torch.Tensor:
            part = tokens[:, : chunk.token_end]
            return flow.stream(
                cache, part, prompt_token, prompt_feat, embedding, chunk.offset, chunk.finalize
            )

        return run_mode(label, chunks, incremental, cache)

    print(f"threads {torch.get_num_threads()}, prompt {args.prompt} tokens, {len(chunks)} chunks")
    inc_mel, inc_rows = incremental_stream("incremental")
    # Later streams reuse the memory the first one freed (kept in the process, as the engine does).
    repeats = [incremental_stream(f"incremental #{n}")[1] for n in range(2, args.repeat + 1)]
    summary: dict[str, float | None] = {
        "incremental_10th_over_2nd_wall": ratio_10_2(inc_rows, "wall_s"),
        "incremental_10th_over_2nd_cpu": ratio_10_2(inc_rows, "cpu_s"),
        "incremental_cache_mb_peak": max(r["cache_mb"] for r in inc_rows),
    }
    exact_rows: list[dict[str, float]] = []
    if not args.skip_exact:
        exact_mel, exact_rows = run_mode("exact", chunks, exact)
        # Upstream's own streaming-vs-offline gap, for scale: the same frames without streaming.
        offline = flow.inference(tokens, prompt_token, prompt_feat, embedding, streaming=False, finalize=True)
        streamed = torch.cat(exact_mel, dim=2)
        diffs = [float((e - i).abs().max()) for e, i in zip(exact_mel, inc_mel, strict=True)]
        print("max |mel exact - incremental| per chunk:", " ".join(f"{d:.2g}" for d in diffs))
        summary |= {
            "exact_10th_over_2nd_wall": ratio_10_2(exact_rows, "wall_s"),
            "exact_10th_over_2nd_cpu": ratio_10_2(exact_rows, "cpu_s"),
            "final_chunk_cpu_s_exact": exact_rows[-1]["cpu_s"],
            "final_chunk_cpu_s_incremental": inc_rows[-1]["cpu_s"],
            "max_abs_mel_diff_intermediate": max(diffs[:-1]),
            "max_abs_mel_diff_final": diffs[-1],
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
        report = {
            "args": vars(args),
            "incremental": inc_rows,
            "incremental_repeats": repeats,
            "exact": exact_rows,
            "summary": summary,
        }
        args.json.write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
