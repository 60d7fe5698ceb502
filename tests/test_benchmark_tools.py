"""That ``benchmarks/load_memory.py``, ``benchmarks/profiles.py`` and
``benchmarks/stream_variants.py`` run and report what docs/performance.md cites
(``benchmarks/upstream_engine.py``: tests/test_benchmark_turns.py;
``benchmarks/precision_quality.py``: tests/accel/test_precision.py)."""

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"


@pytest.mark.slow  # two loads in fresh processes, the page cache dropped between
def test_load_memory_reports_each_setting_and_new_text_reads_no_disk(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    args = ("--settings", "fp32,fp32+int8", "--cold", "--lookups", "3")
    results = _run_script("load_memory.py", tiny_model_dir, tmp_path, *args)["results"]
    assert [result["setting"] for result in results] == ["fp32", "fp32+int8"]
    for result in results:
        assert result["mib"]["VmHWM"] >= result["mib"]["VmRSS"] > 0
        # Dropped from the page cache first, the embedding was read back at load.
        assert result["lookup_major_faults"] == 0


def test_profiles_compares_the_default_with_explicit_flags(tiny_model_dir: Path, tmp_path: Path) -> None:
    args = ("--configs", "no flags (auto),--profile exact", "--tokens", "5", "--repeats", "1")
    report = _run_script("profiles.py", tiny_model_dir, tmp_path, *args)
    results = report["results"]
    assert list(results) == ["no flags (auto)", "--profile exact"]
    assert results["no flags (auto)"]["plan"].startswith("profile auto (")
    assert results["--profile exact"]["plan"].startswith("profile exact (parity with upstream)")
    for result in results.values():
        assert result["wall_s"] > 0 and result["lm_decode_s"] > 0 and result["flow_s"] > 0
    assert report["fastest_explicit"] == "--profile exact"
    assert report["ratio"] == results["no flags (auto)"]["wall_s"] / results["--profile exact"]["wall_s"]


def test_stream_variants_runs_each_variant_in_its_own_process(tiny_model_dir: Path, tmp_path: Path) -> None:
    args = ("--variants", "plan,keys", "--streams", "2", "--bursts", "1", "--tokens", "30")
    reports = _run_script("stream_variants.py", tiny_model_dir, tmp_path, *args)["reports"]
    assert list(reports) == ["plan", "keys"]
    assert reports["plan"]["flow_cache_compact"] is True  # the plan's
    assert reports["keys"]["flow_cache_compact"] is False
    for report in reports.values():
        assert report["plan"].startswith("profile auto (")
        assert report["peak_rss_mb"] > 0
        (burst,) = report["bursts"]
        assert burst["wall_s"] > 0 and burst["audio_s_per_s"] > 0
        assert burst["engine"]["flow_calls"] > 0 and burst["engine"]["flow_rows"] >= 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--variants", "plan,rows8"), "variant 'rows8' changes settings CosyVoice 2's flow has"),
        (("--variants", "plan,plan"), "each variant may be named once"),
        (("--variants", "plan,fast"), "unknown variant 'fast'"),
        (("--streams", "0"), "--streams must be at least 1"),
    ],
)
def test_stream_variants_refuses_bad_arguments(
    tiny3_model_dir: Path, args: tuple[str, ...], message: str
) -> None:
    command = [sys.executable, str(BENCHMARKS / "stream_variants.py"), "--model-dir", str(tiny3_model_dir)]
    done = subprocess.run([*command, *args], capture_output=True, text=True)
    assert done.returncode == 2
    assert message in done.stderr


def _run_script(name: str, model_dir: Path, tmp_path: Path, *args: str) -> Any:
    """Run ``benchmarks/<name>`` on ``model_dir`` with ``args``; the JSON report it wrote."""
    out = tmp_path / "report.json"
    command = [sys.executable, str(BENCHMARKS / name), "--model-dir", str(model_dir), *args]
    subprocess.run([*command, "--json", str(out)], check=True, capture_output=True)
    return json.loads(out.read_text())
