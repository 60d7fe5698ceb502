"""``cosyserve synth`` with no precision flags against the explicit flag combinations, on
this machine: is the default plan the fastest?

    .venv/bin/python benchmarks/profiles.py --model-dir DIR [--tokens 150] [--prompt-seconds 3]
        [--repeats 2] [--json out.json]

Each configuration is one ``cosyserve synth`` process (the real command, model load
included), a non-streaming zero-shot request for exactly ``--tokens`` speech tokens with a
``--prompt-seconds`` voice prompt, seed 0. The configurations take turns, ``--repeats``
rounds, so that a machine whose speed drifts slows each alike; the medians are reported.
The last line compares the default (no flags, the ``auto`` profile) with the fastest
explicit combination: within 5 % is the target (docs/performance.md). On a CPU without
bfloat16 instructions the bf16 combinations are left out (said in the output): torch
emulates their matmuls, about 100x slower than float32 (docs/precision.md), so they cannot
be the fastest and one run would take many minutes.
"""

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf
from common import model_dir_parser  # benchmarks/, the script's own directory

from cosyserve.accel.machine import Machine

# The default, the parity profile, and every precision combination a user could pass.
CONFIGS: dict[str, list[str]] = {
    "no flags (auto)": [],
    "--profile exact": ["--profile", "exact"],
    "--dtype bf16 --quantize int8": ["--profile", "exact", "--dtype", "bf16", "--quantize", "int8"],
    "--dtype bf16": ["--profile", "exact", "--dtype", "bf16"],
    "--quantize int8": ["--profile", "exact", "--quantize", "int8"],
    "--flow-quantize fp16": ["--profile", "exact", "--flow-quantize", "fp16"],
    "--quantize int8 --flow-quantize fp16": [
        *("--profile", "exact", "--quantize", "int8", "--flow-quantize", "fp16"),
    ],
}
# Explicit flags run over the exact profile, so that they alone decide the precision.
TARGET = 1.05
TEXT = "收到好友从远方寄来的生日礼物，那份意外的惊喜与深深的祝福让我心中充满了甜蜜的快乐。"
PROMPT_TEXT = "希望你以后能够做的比我还好呦。"
RATE = 24000


def prompt_wav(path: Path, seconds: float) -> Path:
    """A speech-like recording: a gliding harmonic tone under noise, seeded."""
    rng = np.random.default_rng(0)
    t = np.arange(int(seconds * RATE)) / RATE
    pitch = 140 + 40 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(pitch) / RATE
    voice = sum(np.sin(k * phase) / k for k in range(1, 6)) * (0.5 + 0.5 * np.sin(2 * np.pi * 3 * t) ** 2)
    audio = 0.2 * voice + 0.01 * rng.standard_normal(t.size)
    sf.write(path, audio.astype(np.float32), RATE)
    return path


def synth(model_dir: Path, prompt: Path, out: Path, tokens: int, flags: list[str]) -> dict[str, Any]:
    command = [sys.executable, "-c", "from cosyserve.cli.main import main; main()", "synth", TEXT]
    command += ["--model-dir", str(model_dir), "--prompt-wav", str(prompt), "--prompt-text", PROMPT_TEXT]
    command += ["--tokens", str(tokens), "--seed", "0", "-o", str(out), "--json", *flags]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"synth {' '.join(flags)} failed:\n{done.stderr[-2000:]}")
    report: dict[str, Any] = json.loads(done.stdout)
    return report


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def median(key: str) -> float:
        return statistics.median(r["stages"][key] if key in r["stages"] else r[key] for r in runs)

    return {
        "wall_s": median("wall_s"),
        "lm_decode_s": median("lm_decode_s"),
        "flow_s": median("flow_s"),
        "hift_s": median("hift_s"),
        "model_load_s": median("model_load_s"),
        "peak_rss_mib": median("peak_rss_mib"),
        "plan": runs[-1]["plan"],
        "walls": [r["wall_s"] for r in runs],
    }


def main() -> None:
    parser = model_dir_parser(__doc__)
    parser.add_argument("--tokens", type=int, default=150, help="speech tokens forced (6 s of audio)")
    parser.add_argument("--prompt-seconds", type=float, default=3.0)
    parser.add_argument("--repeats", type=int, default=2, help="rounds of every configuration, in turns")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names (default: all)")
    args = parser.parse_args()
    names = [name.strip() for name in args.configs.split(",")]
    unknown = set(names) - set(CONFIGS)
    if unknown or "no flags (auto)" not in names:
        parser.error(f"--configs takes {list(CONFIGS)}, 'no flags (auto)' among them")
    if not Machine.detect().cpu.native_bf16:
        emulated = [name for name in names if "bf16" in name]
        names = [name for name in names if name not in emulated]
        if emulated:
            print(f"left out, bf16 emulated on this CPU: {', '.join(emulated)}", flush=True)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        prompt = prompt_wav(Path(tmp) / "prompt.wav", args.prompt_seconds)
        for round_ in range(args.repeats):
            for name in names:
                print(f"round {round_ + 1}: {name}", file=sys.stderr, flush=True)
                runs[name].append(
                    synth(args.model_dir, prompt, Path(tmp) / "out.wav", args.tokens, CONFIGS[name])
                )
    results = {name: summary(r) for name, r in runs.items()}
    explicit = {name: r for name, r in results.items() if name != "no flags (auto)"}
    best = min(explicit, key=lambda name: explicit[name]["wall_s"]) if explicit else None
    default = results["no flags (auto)"]
    ratio = None if best is None else default["wall_s"] / explicit[best]["wall_s"]
    print(f"`cosyserve synth`, {args.tokens} tokens, {args.prompt_seconds:g} s prompt, non-streaming, "
          f"medians of {args.repeats}; default plan: {default['plan']}")  # fmt: skip
    print("| flags | wall (s) | LM decode (s) | flow (s) | HiFT (s) | load (s) | peak RSS (MiB) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        print(
            f"| {name} | {r['wall_s']:.2f} | {r['lm_decode_s']:.2f} | {r['flow_s']:.2f} | {r['hift_s']:.2f} "
            f"| {r['model_load_s']:.1f} | {r['peak_rss_mib']:.0f} |"
        )
    if ratio is not None:
        met = "met" if ratio <= TARGET else "NOT met"
        print(f"no flags / fastest explicit ({best}): {ratio:.3f} (target <= {TARGET}: {met})")
    if args.json is not None:
        report = {"tokens": args.tokens, "prompt_seconds": args.prompt_seconds, "repeats": args.repeats}
        report |= {"results": results, "fastest_explicit": best, "ratio": ratio, "target": TARGET}
        args.json.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
