"""Concurrent streams on cosyserve's engine in this machine's plan and in variants of its
stream settings: what each costs in time and in memory.

    .venv/bin/python benchmarks/stream_variants.py --model-dir DIR [--streams 8] [--bursts 2]
        [--variants plan,rows8,keys,fp32-weights] [--tokens 150] [--prompt-seconds 3]
        [--json out.json]

Each variant runs in a process of its own, so that its peak RSS is its own; the processes
take turns (``benchmarks/common.py``): all load, then each runs its first burst of
``--streams`` streams while the others wait, then each its second, and so on, so that a
machine whose speed drifts slows every variant alike. Every stream is a zero-shot request of
``--tokens`` forced speech tokens with a ``--prompt-seconds`` prompt, each with a text of its
own (CosyVoice 3's LM prompt opens with its system prompt, as our frontend's does); a
warm-up stream of the same voice first primes the voice's flow prompt, as the first stream
of a voice does in a server. The first burst's flow caches are new memory; a later
burst reuses what the process kept.

Variants (the plan's other choices unchanged):

- ``plan``: the plan ``--profile`` picks here (default ``auto``, what ``cosyserve serve`` runs);
- ``rows8``: every stream's chunk in one flow call (``EngineConfig.flow_stream_rows = 8``;
  the plan's is 2), CosyVoice 2;
- ``keys``: streams hold their flow caches' keys and values instead of the attention
  inputs they are recomputed from (``flow_cache_compact = False``), CosyVoice 2;
- ``fp32-weights``: the flow's Linear weights in float32 (``--flow-quantize none``), where
  the plan holds them in float16.

The report gives per variant its plan and stream settings, per burst the wall time, audio
seconds per wall second and the engine's seconds per stage, and the process's peak RSS
from its start (loading included).
"""

import argparse
import dataclasses
import itertools
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Turns, model_dir_parser, take_turns

from cosyserve.accel.machine import Machine
from cosyserve.accel.plan import Choices, choose_plan
from cosyserve.accel.precision_choices import FlowQuantization, Profile
from cosyserve.bench.engine_bench import peak_rss_mb
from cosyserve.bench.workload import family_prompt, synthetic_spec, synthetic_text_ids, synthetic_voice
from cosyserve.engine.engine import Engine
from cosyserve.engine.loader import engine_config_for, load_model
from cosyserve.memory import retain_freed_memory
from cosyserve.modeldir.family import Family
from cosyserve.modeldir.layout import ModelDir
from cosyserve.pipeline.voice import VoicePrompt

# Each variant: its EngineConfig changes, its flow weights' storage (None: the plan's), and
# whether it applies to CosyVoice 3 (whose streams batch and cache their own way).
VARIANTS: dict[str, tuple[dict[str, Any], FlowQuantization | None, bool]] = {
    "plan": ({}, None, True),
    "rows8": ({"flow_stream_rows": 8}, None, False),
    "keys": ({"flow_cache_compact": False}, None, False),
    "fp32-weights": ({}, FlowQuantization.NONE, True),
}
STAGES = ("prefill_s", "decode_s", "flow_s", "hift_s", "flow_calls", "flow_rows")


def run_variant(args: argparse.Namespace) -> dict[str, Any]:
    """One variant's bursts, each after its turn: the report line's content."""
    turns = Turns(True)
    retain_freed_memory()  # as the server does
    changes, flow_weights, _ = VARIANTS[args.worker]
    directory = ModelDir.open(args.model_dir)
    hparams = directory.hparams()
    voice = synthetic_voice(hparams, args.prompt_seconds, seed=args.seed, name="bench")
    voice = family_prompt(directory, voice)
    count = 1 + args.streams * args.bursts
    texts = [synthetic_text_ids(hparams, args.tokens, seed=args.seed + i) for i in range(count)]
    turns.wait()
    plan = choose_plan(Machine.detect(), args.profile, Choices(flow_quantize=flow_weights))
    model = load_model(args.model_dir, plan)
    config = engine_config_for(model, max_active=max(8, args.streams), max_waiting=args.streams)
    config = dataclasses.replace(config, **changes)
    engine = Engine(model.lm, model.flow, model.hift, config)
    ids = (f"s{n}" for n in itertools.count())
    _streams(engine, voice, texts[:1], ids, args)  # the warm-up: primes the voice's flow prompt
    bursts = []
    for n in range(args.bursts):
        turns.wait()
        before = engine.stats.snapshot()
        start = time.perf_counter()
        samples = _streams(engine, voice, texts[1 + n * args.streams : 1 + (n + 1) * args.streams], ids, args)
        wall = time.perf_counter() - start
        after = engine.stats.snapshot()
        spent = {key: round(getattr(after, key) - getattr(before, key), 3) for key in STAGES}
        rate = samples / hparams.sample_rate / wall
        bursts.append({"wall_s": round(wall, 2), "audio_s_per_s": round(rate, 4), "engine": spent})
    settings = {name: getattr(config, name) for name in ("flow_stream_rows", "flow_cache_compact")}
    return {"plan": model.plan.describe(), **settings, "bursts": bursts, "peak_rss_mb": round(peak_rss_mb())}


def _streams(
    engine: Engine,
    voice: VoicePrompt,
    texts: list[tuple[int, ...]],
    ids: Iterator[str],
    args: argparse.Namespace,
) -> int:
    """Stream one request per text at once to their ends; the samples made. A failed
    request stops the benchmark."""
    for text in texts:
        engine.add(synthetic_spec(next(ids), voice, text, tokens=args.tokens, seed=args.seed, stream=True))
    samples = 0
    while engine.has_work():
        for out in engine.step():
            if out.error is not None:
                raise SystemExit(f"a stream failed: {out.error}")
            if out.audio is not None:
                samples += int(out.audio.size)
    return samples


def main() -> None:
    parser = model_dir_parser(__doc__)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--bursts", type=int, default=2)
    parser.add_argument("--variants", default="plan,rows8,keys,fp32-weights")
    parser.add_argument("--tokens", type=int, default=150, help="speech tokens forced per stream")
    parser.add_argument("--prompt-seconds", type=float, default=3.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", choices=[p.value for p in Profile], default="auto")
    parser.add_argument("--worker", choices=list(VARIANTS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        print(json.dumps(run_variant(args)), flush=True)
        return
    for option in ("streams", "bursts", "tokens"):
        if getattr(args, option) < 1:
            parser.error(f"--{option} must be at least 1")
    if args.prompt_seconds <= 0:
        parser.error("--prompt-seconds must be positive")
    names = [name.strip() for name in args.variants.split(",")]
    if len(set(names)) != len(names):
        parser.error("each variant may be named once")
    family = ModelDir.open(args.model_dir).family
    for name in names:
        if name not in VARIANTS:
            parser.error(f"unknown variant {name!r}; known: {', '.join(VARIANTS)}")
        if family is Family.COSYVOICE3 and not VARIANTS[name][2]:
            parser.error(f"variant {name!r} changes settings CosyVoice 2's flow has, not CosyVoice 3's")
    workload = [
        *("--model-dir", str(args.model_dir), "--streams", str(args.streams), "--bursts", str(args.bursts)),
        *("--tokens", str(args.tokens), "--prompt-seconds", str(args.prompt_seconds)),
        *("--seed", str(args.seed), "--profile", args.profile),
    ]
    commands = {name: [sys.executable, __file__, *workload, "--worker", name] for name in names}
    reports = {name: json.loads(line) for name, line in take_turns(commands, 1 + args.bursts).items()}
    for name, report in reports.items():
        for n, burst in enumerate(report["bursts"]):
            spent = burst["engine"]
            print(
                f"{name:>12} burst {n + 1}: {burst['wall_s']:7.1f} s, "
                f"{burst['audio_s_per_s']:.3f} audio s/s, flow {spent['flow_s']:.1f} s "
                f"in {spent['flow_calls']} calls, hift {spent['hift_s']:.1f} s, "
                f"decode {spent['decode_s']:.1f} s"
            )
        print(f"{name:>12} peak RSS {report['peak_rss_mb']} MiB; {report['plan']}")
    if args.json is not None:
        args.json.write_text(json.dumps({"args": vars(args), "reports": reports}, default=str, indent=1))


if __name__ == "__main__":
    main()
