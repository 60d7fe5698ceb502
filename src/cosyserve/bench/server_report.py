"""The server load benchmark's report as JSON and as a Markdown table."""

import dataclasses
import json

from cosyserve.bench.engine_bench import Percentiles
from cosyserve.bench.server_load import ServerLoadReport


def server_report_json(report: ServerLoadReport) -> str:
    return json.dumps(dataclasses.asdict(report), indent=2, ensure_ascii=False) + "\n"


def server_report_markdown(report: ServerLoadReport) -> str:
    """A header naming the target and workload, then one table row per level."""
    mode = "streaming" if report.stream else "non-streaming"
    tokens = "model-chosen length" if report.tokens is None else f"{report.tokens} forced speech tokens"
    lines = [
        f"Server load: `{report.url}` ({report.api} API), {mode} {report.format}, voice "
        f"`{report.voice or 'prompt recording'}`, {tokens}, {report.requests} requests per level.",
        "",
        "| concurrency | ok | aborted | errors | first byte p50 / p95 / p99 (s) "
        "| total p50 / p95 / p99 (s) | 429 after max (ms) | req/s | audio s/s |",
        "|---:|---:|---:|---|---|---|---:|---:|---:|",
    ]
    for level in report.levels:
        errors = ", ".join(f"{k}: {v}" for k, v in level.errors.items()) or "0"
        refusal = "-" if level.max_refusal_s is None else f"{level.max_refusal_s * 1000:.0f}"
        audio = "-" if level.audio_s_per_s is None else f"{level.audio_s_per_s:.2f}"
        lines.append(
            f"| {level.concurrency} | {level.ok} | {level.aborted} | {errors} | "
            f"{_triple(level.first_byte_s)} | {_triple(level.total_s)} | {refusal} | "
            f"{level.requests_per_s:.2f} | {audio} |"
        )
    return "\n".join(lines) + "\n"


def _triple(p: Percentiles | None) -> str:
    return "-" if p is None else f"{p.p50:.2f} / {p.p95:.2f} / {p.p99:.2f}"
