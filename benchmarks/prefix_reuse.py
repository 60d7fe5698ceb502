"""What the LM prefix cache saves: prefill positions and seconds per request, with and
without it (docs/benchmarks.md has the figures).

    .venv/bin/python benchmarks/prefix_reuse.py --model-dir DIR [--prompt-seconds 3]
        [--tokens 150] [--repeats 5]

One voice (``--prompt-seconds`` of synthetic prompt), requests sized for ``--tokens`` speech
tokens. Three cases, each timed ``--repeats`` times after a warm-up, in an engine with the
cache and in one without (taking turns):

- ``new text``: every request speaks another text: only ``[sos] + prompt text`` (in whole
  blocks of 4 positions) can come from the cache;
- ``same text``: the same request again: everything but the last position can;
- ``cold``: the first request of a voice (nothing cached), for reference.

Only the prefill is timed (the engine's own prefill clock); each request is aborted after
its first token, so no flow or vocoder work is done.
"""

import argparse
import statistics
import sys
from pathlib import Path

from cosyserve.bench.workload import synthetic_spec, synthetic_text_ids, synthetic_voice
from cosyserve.engine.engine import Engine
from cosyserve.engine.loader import LoadedModel, engine_config_for, load_model
from cosyserve.engine.request import GenerationSpec


def prefill(engine: Engine, spec: GenerationSpec) -> tuple[float, int]:
    """Seconds and positions of prefill until ``spec``'s first token."""
    before_s, before_n = engine.stats.prefill_s, engine.stats.prefill_tokens
    engine.add(spec)
    while not any(r.lm_state.tokens for r in engine.scheduler.running if r.slot is not None):
        engine.step()
    engine.abort(spec.request_id)
    return engine.stats.prefill_s - before_s, engine.stats.prefill_tokens - before_n


def measure(model: LoadedModel, args: argparse.Namespace) -> dict[str, dict[bool, tuple[float, int]]]:
    """case -> {cached: (median prefill seconds, prefill positions)}. The two engines take
    turns request by request, so that a machine whose load drifts favours neither."""
    hp = model.hparams
    engines = {
        cached: Engine(
            model.lm, model.flow, model.hift, engine_config_for(model, max_active=1, prefix_cache_positions=n)
        )
        for cached, n in ((False, 0), (True, 2048))
    }
    counter = iter(range(1_000_000))

    def spec(text_seed: int, voice_seed: int) -> GenerationSpec:
        voice = synthetic_voice(hp, args.prompt_seconds, seed=voice_seed)
        text = synthetic_text_ids(hp, args.tokens, seed=text_seed)
        return synthetic_spec(f"r{next(counter)}", voice, text, tokens=args.tokens)

    runs: dict[str, dict[bool, list[tuple[float, int]]]] = {}
    for engine in engines.values():
        prefill(engine, spec(0, 0))  # warm-up (and voice 0 cached)
        prefill(engine, spec(300, 0))  # the text repeated below
    for i in range(args.repeats):
        cases = {"cold": (100 + i, 1000 + i), "new text": (200 + i, 0), "same text": (300, 0)}
        for case, seeds in cases.items():
            for cached in (i % 2 == 0, i % 2 == 1):
                runs.setdefault(case, {}).setdefault(cached, []).append(
                    prefill(engines[cached], spec(*seeds))
                )
    return {
        case: {cached: (statistics.median(t for t, _ in r), r[0][1]) for cached, r in by.items()}
        for case, by in runs.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--prompt-seconds", type=float, default=3.0)
    parser.add_argument("--tokens", type=int, default=150, help="speech tokens the text is sized for")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    model = load_model(args.model_dir)
    print("| case | prefill positions (without / with) | prefill s, median (without / with) | saved |")
    print("|---|---:|---:|---:|")
    for case, by in measure(model, args).items():
        (t0, n0), (t1, n1) = by[False], by[True]
        saved = f"{100 * (1 - t1 / t0):.0f} %" if t0 > 0 else "n/a"
        print(f"| {case} | {n0} / {n1} | {t0:.3f} / {t1:.3f} | {saved} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
