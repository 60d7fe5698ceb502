"""Per-stage timing of ``cosyserve synth`` on the full-size (random-weight) model.

One command for the whole measurement (docs/synth.md has the numbers it gave):

    .venv/bin/python benchmarks/synth_stages.py --model-dir /tmp/cv2-full-synth

If the model directory does not exist it is created first (``cosyserve model init DIR
--size full --seed 0``, about 1 min and 3.4 GB) and deleted at the end unless ``--keep``.
Then a 3.0 s 24 kHz prompt (harmonics plus noise, seeded) is written and ``cosyserve synth``
runs zero-shot with ``--tokens 150`` (6.0 s of audio) once non-streaming and once with
``--stream``, each in its own process under ``/usr/bin/time -v`` (peak RSS, model load
included). The machine's load average is recorded before and after every run, since a
busy machine makes every number pessimistic. Prints a Markdown table and the raw JSON.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf

TEXT = "八百标兵奔北坡，北坡炮兵并排跑，炮兵怕把标兵碰，标兵怕碰炮兵炮。"
PROMPT_TEXT = "希望你以后能够做的比我还好呦。"
RATE = 24000
COSYSERVE = Path(sys.executable).parent / "cosyserve"


def write_prompt(path: Path, seconds: float = 3.0, seed: int = 0) -> None:
    """A speech-like prompt: five harmonics of a gliding 140 Hz tone, syllable-rate
    amplitude modulation and a little white noise, 16-bit at 24 kHz."""
    gen = np.random.default_rng(seed)
    t = np.arange(round(seconds * RATE)) / RATE
    phase = 2 * np.pi * np.cumsum(140 + 20 * np.sin(2 * np.pi * 0.7 * t)) / RATE
    voiced = sum(np.sin(k * phase) / k for k in range(1, 6))
    wav = 0.2 * (0.6 + 0.4 * np.sin(2 * np.pi * 3 * t) ** 2) * voiced + 0.01 * gen.standard_normal(t.size)
    sf.write(path, wav.astype(np.float32), RATE, subtype="PCM_16")


def source_version() -> str:
    """The commit measured, and whether files under src/ differed from it."""
    repo = Path(__file__).resolve().parent.parent
    git = ["git", "-C", str(repo)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
    dirty = subprocess.run([*git, "status", "--porcelain", "src"], capture_output=True, text=True).stdout
    return head.strip() + (f" + {len(dirty.splitlines())} changed files under src/" if dirty else "")


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def run_synth(cmd: list[str]) -> dict[str, Any]:
    """Run one ``cosyserve synth --json`` under ``/usr/bin/time -v``; its report plus
    the peak RSS and the load averages around it."""
    before = load_average()
    done = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True, check=False)
    after = load_average()
    if done.returncode != 0:
        sys.exit(f"cosyserve synth failed ({done.returncode}):\n{done.stderr}")
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr)
    process_wall = re.search(r"Elapsed \(wall clock\) time.*: ([\d:.]+)", done.stderr)
    report: dict[str, Any] = json.loads(done.stdout)
    report["time_v_peak_rss_mib"] = int(rss.group(1)) / 1024 if rss else None
    report["process_wall"] = process_wall.group(1) if process_wall else None
    # CPU seconds of the whole process (load included) per wall second: how many of the
    # cores it actually got, the plainest sign of a contended machine.
    cpu = [float(m) for m in re.findall(r"(?:User|System) time \(seconds\): ([\d.]+)", done.stderr)]
    report["process_cpu_s"] = sum(cpu)
    report["load_avg_before"] = before
    report["load_avg_after"] = after
    report["command"] = " ".join(cmd)
    return report


def table(reports: list[dict[str, Any]]) -> list[str]:
    rows = [
        "| run | audio | wall | RTF | first chunk | load | frontend | LM prefill | LM decode | flow | HiFT "
        "| peak RSS | process CPU s | load avg (1/5/15 min) before -> after |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in reports:
        s, c = r["stages"], r["counters"]
        first = f"{r['first_chunk_s']:.1f} s"
        if r["stream"]:
            first += f" ({r['first_chunk_audio_s']:.2f} s audio)"
        rows.append(
            f"| {'stream' if r['stream'] else 'non-stream'} | {r['audio_s']:.2f} s | {r['wall_s']:.1f} s "
            f"| {r['rtf']:.2f} | {first} | {s['model_load_s']:.1f} s | {s['frontend_s']:.2f} s "
            f"| {s['lm_prefill_s']:.2f} s ({c['prefill_positions']} pos) "
            f"| {s['lm_decode_s']:.1f} s ({c['decode_tokens_per_s']:.2f} tok/s) "
            f"| {s['flow_s']:.1f} s ({c['flow_calls']} calls) "
            f"| {s['hift_s']:.2f} s ({c['hift_calls']} calls) "
            f"| {r['time_v_peak_rss_mib'] / 1024:.2f} GiB | {r['process_cpu_s']:.0f} s "
            f"| {r['load_avg_before']} -> {r['load_avg_after']} |"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/cv2-full-synth"))
    parser.add_argument("--tokens", type=int, default=150, help="forced speech tokens (0.04 s each)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", action="store_true", help="keep a model directory this script created")
    args = parser.parse_args()

    version = source_version()  # before the runs: the code they import
    created = not args.model_dir.exists()
    if created:
        start = time.perf_counter()
        init = [str(COSYSERVE), "model", "init", str(args.model_dir), "--size", "full", "--seed", "0"]
        subprocess.run(init, check=True, stdout=subprocess.DEVNULL)
        print(f"created {args.model_dir} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            prompt = Path(tmp) / "prompt.wav"
            write_prompt(prompt)
            reports = []
            for stream in (False, True):
                cmd = [str(COSYSERVE), "synth", "--model-dir", str(args.model_dir), TEXT]
                cmd += ["--prompt-wav", str(prompt), "--prompt-text", PROMPT_TEXT]
                cmd += ["--tokens", str(args.tokens), "--seed", str(args.seed), "--json"]
                cmd += ["-o", str(Path(tmp) / f"out_{'stream' if stream else 'nonstream'}.wav")]
                cmd += ["--stream"] if stream else []
                print(f"running ({load_average()}): {' '.join(cmd)}", file=sys.stderr)
                reports.append(run_synth(cmd))
    finally:
        if created and not args.keep:
            shutil.rmtree(args.model_dir)
    print(f"cores: {os.cpu_count()}, cosyserve {version}")
    print("\n".join(table(reports)))
    print(json.dumps(reports, indent=2, ensure_ascii=False))


if __name__ == "__main__":
    main()
