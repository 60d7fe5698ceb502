"""Memory and time of loading the model, per precision setting, each in a new process.

    .venv/bin/python benchmarks/load_memory.py --model-dir /tmp/cv2-full-bench \\
        [--settings fp32,fp32+int8,bf16,bf16+int8] [--cold] [--lookups 10] [--json FILE]

For each setting (``dtype`` or ``dtype+quantize``) a new interpreter loads the model
(``load_model``, 2 torch threads) and reports, from ``/proc/self/status``: the peak
resident memory while loading (``VmHWM``), the resident memory after it (``VmRSS``), split
into anonymous pages (``RssAnon``: converted and quantized weights) and file pages
(``RssFile``: the touched pages of the memory-mapped checkpoints), and the load seconds.
It then looks up ``--lookups`` new random texts of 26 tokens in the text embedding, as
requests with new text do, and reports their milliseconds in all and the major page
faults meanwhile (rows read from disk).

``--cold`` first drops the checkpoints' pages from the page cache
(``posix_fadvise(POSIX_FADV_DONTNEED)``), as after a reboot: loading reads from disk.
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

_CHILD = """
import json, resource, sys, time
import torch
from cosyserve.engine.loader import load_model

model_dir, dtype, quantize, lookups = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
start = time.perf_counter()
model = load_model(model_dir, dtype=dtype, quantize=quantize, threads=2)
load_s = time.perf_counter() - start
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
mib = {key: int(status[key].split()[0]) / 1024 for key in ("VmHWM", "VmRSS", "RssAnon", "RssFile")}
embedding = model.lm.qwen.embed_tokens
generator = torch.Generator().manual_seed(1)
before = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
start = time.perf_counter()
with torch.inference_mode():
    for _ in range(lookups):
        embedding(torch.randint(0, embedding.num_embeddings, (26,), generator=generator))
lookup_ms = 1e3 * (time.perf_counter() - start)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_majflt - before
print(json.dumps({"load_s": load_s, "mib": mib, "lookup_ms": lookup_ms, "lookup_major_faults": faults}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--settings", default="fp32,fp32+int8,bf16,bf16+int8")
    parser.add_argument("--cold", action="store_true", help="drop the checkpoints from the page cache first")
    parser.add_argument("--lookups", type=int, default=10)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results: list[dict[str, Any]] = []
    print("| setting | load s | peak RSS MiB | RSS after | anon | file | 10 lookups ms | major faults |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for setting in args.settings.split(","):
        dtype, _, quantize = setting.partition("+")
        if args.cold:
            for name in ("llm.pt", "flow.pt", "hift.pt"):
                _drop_from_page_cache(args.model_dir / name)
        out = subprocess.run(
            [sys.executable, "-c", _CHILD, str(args.model_dir), dtype, quantize or "none", str(args.lookups)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        result = {"setting": setting, "cold": args.cold} | json.loads(out.stdout.splitlines()[-1])
        results.append(result)
        mib = result["mib"]
        print(
            f"| {setting} | {result['load_s']:.1f} | {mib['VmHWM']:.0f} | {mib['VmRSS']:.0f} | "
            f"{mib['RssAnon']:.0f} | {mib['RssFile']:.0f} | {result['lookup_ms']:.1f} | "
            f"{result['lookup_major_faults']} |",
            flush=True,
        )
    if args.json is not None:
        report = {"args": {k: str(v) for k, v in vars(args).items()}, "results": results}
        args.json.write_text(json.dumps(report, indent=2))


def _drop_from_page_cache(path: Path) -> None:
    """Evict ``path``'s pages from the page cache (no root needed; written pages go once
    they are on disk)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


if __name__ == "__main__":
    main()
