"""The engine benchmark's report as JSON and as a Markdown table."""

import dataclasses
import json
from typing import Any

from cosyserve.bench.engine_bench import BenchReport, Percentiles


def report_dict(report: BenchReport) -> dict[str, Any]:
    """Everything measured, as plain JSON-able data."""
    return dataclasses.asdict(report)


def report_json(report: BenchReport) -> str:
    return json.dumps(report_dict(report), indent=2, ensure_ascii=False) + "\n"


def report_markdown(report: BenchReport) -> str:
    """A header naming the workload and machine state, then one table row per level."""
    opts = report.options
    mode = "streaming" if opts.stream else "non-streaming"
    load = ", ".join(f"{x:.2f}" for x in report.load_average_before)
    lines = [
        f"Engine benchmark: `{report.model_dir}`, {mode}, {opts.tokens} forced speech tokens "
        f"({opts.tokens / 25:.2f} s of audio) per request, {opts.prompt_seconds:g} s synthetic prompt, "
        f"{opts.rounds} rounds per level; plan {_plan_line(report.plan)}, KV cache {report.kv_cache_dtype}; "
        f"torch threads {report.torch_threads} of {report.cpu_count} CPUs; load average before: {load}.",
        "",
        "| concurrency | requests | first chunk p50 / p95 / p99 (s) | total p50 / p95 / p99 (s) "
        "| RTF | audio s/s | LM tokens/s | peak RSS (MiB) | load avg (1 min, after) |",
        "|---:|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for level in report.levels:
        rss = f"{level.peak_rss_mb:.0f}" + ("" if level.rss_peak_is_level else " (since start)")
        if level.peak_device_mb is not None:
            rss += f"; device {level.peak_device_mb:.0f}"
        lines.append(
            f"| {level.concurrency} | {level.requests} | {_triple(level.first_chunk_s)} | "
            f"{_triple(level.total_s)} | {level.rtf:.2f} | {level.audio_s_per_s:.2f} | "
            f"{level.lm_tokens_per_s:.1f} | {rss} | {level.load_average[0]:.2f} |"
        )
    return "\n".join(lines) + "\n"


def _triple(p: Percentiles) -> str:
    return f"{p.p50:.2f} / {p.p95:.2f} / {p.p99:.2f}"


def _plan_line(labels: dict[str, str]) -> str:
    """``Plan.describe``'s line, from its labels (what the JSON report keeps)."""
    shown = " ".join(f"{k}={v}" for k, v in labels.items() if k not in ("profile", "basis"))
    return f"profile {labels['profile']} ({labels['basis']}): {shown}"
