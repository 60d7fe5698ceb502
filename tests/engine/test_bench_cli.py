"""``cosyserve bench engine`` on the tiny model: every level measured, JSON and Markdown."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cosyserve.cli.main import app
from cosyserve.engine.engine import Engine
from cosyserve.engine.request import GenerationSpec
from cosyserve.modeldir.layout import ModelDir
from cosyserve.pipeline.llm_prompt import system_prompt


def test_bench_engine_reports_every_level(tiny_model_dir: Path, tmp_path: Path) -> None:
    out_json, out_md = tmp_path / "bench.json", tmp_path / "bench.md"
    args = ["bench", "engine", "--model-dir", str(tiny_model_dir), "--tokens", "12", "--concurrency", "1,3"]
    args += ["--stream", "--first-hop", "5", "--prompt-seconds", "0.4", "--rounds", "1", "--no-progress"]
    args += ["--profile", "exact"]
    result = CliRunner().invoke(app, [*args, "--json", str(out_json), "--markdown", str(out_md)])
    assert result.exit_code == 0, result.output
    report = json.loads(out_json.read_text())
    assert (report["plan"]["profile"], report["plan"]["flow_cache"]) == ("exact", "cached")
    assert [level["concurrency"] for level in report["levels"]] == [1, 3]
    assert [level["requests"] for level in report["levels"]] == [1, 3]
    for level in report["levels"]:
        first, total = level["first_chunk_s"], level["total_s"]
        assert 0 < first["p50"] <= first["p95"] <= first["p99"]
        assert first["p50"] < total["p50"]  # streams: the first chunk came before the end
        # 12 tokens = 0.48 s of audio per request.
        assert abs(level["audio_s_per_s"] * level["wall_s"] - 0.48 * level["requests"]) < 0.05
        assert abs(level["lm_tokens_per_s"] * level["wall_s"] - 12 * level["requests"]) < 1e-6
        assert level["peak_rss_mb"] > 0
        assert level["peak_device_mb"] is None  # a CPU run
        assert all(level["stage_s"][stage] > 0 for stage in ("prefill", "decode", "flow", "hift"))
        assert sum(level["stage_s"].values()) < level["wall_s"]
    table = out_md.read_text()
    assert result.stdout == table
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + 2 and rows[1].startswith("| 1 | 1 |") and rows[2].startswith("| 3 | 3 |")


def test_bench_engine_runs_the_fast_plan(tiny_model_dir: Path, tmp_path: Path) -> None:
    out_json = tmp_path / "bench.json"
    args = ["bench", "engine", "--model-dir", str(tiny_model_dir), "--tokens", "12", "--concurrency", "1"]
    args += ["--stream", "--prompt-seconds", "1.0", "--rounds", "1", "--no-progress"]
    result = CliRunner().invoke(app, [*args, "--profile", "fast", "--json", str(out_json)])
    assert result.exit_code == 0, result.output
    plan = json.loads(out_json.read_text())["plan"]
    assert (plan["profile"], plan["flow_cache"], plan["flow_prompt_whole"], plan["first_hop"]) == (
        "fast",
        "incremental",
        "on",
        "5",
    )
    assert "plan profile fast (" in result.stdout and "flow_prompt_whole=on" in result.stdout


def test_bench_engine_rejects_bad_levels(tiny_model_dir: Path) -> None:
    result = CliRunner().invoke(
        app, ["bench", "engine", "--model-dir", str(tiny_model_dir), "--concurrency", "2,x"]
    )
    assert result.exit_code == 2
    assert "comma-separated" in result.stderr


def test_bench_engine_reports_the_precision(tiny_model_dir: Path, tmp_path: Path) -> None:
    out_json = tmp_path / "bench.json"
    args = ["bench", "engine", "--model-dir", str(tiny_model_dir), "--tokens", "5", "--concurrency", "1"]
    args += ["--profile", "exact", "--dtype", "bf16", "--rounds", "1", "--prompt-seconds", "0.4"]
    result = CliRunner().invoke(app, [*args, "--no-warm-up", "--no-progress", "--json", str(out_json)])
    assert result.exit_code == 0, result.output
    report = json.loads(out_json.read_text())
    plan = report["plan"]
    assert (plan["dtype"], plan["quantize"], plan["flow_quantize"], plan["device"]) == (
        "bf16",
        "none",
        "none",
        "cpu",
    )
    assert report["kv_cache_dtype"] == "bfloat16"
    assert report["levels"][0]["requests"] == 1
    header = result.stdout.splitlines()[0]
    assert (
        "device=cpu dtype=bf16 quantize=none flow_quantize=none" in header and "KV cache bfloat16" in header
    )


def test_bench_engine_refuses_a_precision_this_machine_cannot_run(tiny_model_dir: Path) -> None:
    result = CliRunner().invoke(
        app, ["bench", "engine", "--model-dir", str(tiny_model_dir), "--dtype", "fp16", "--no-progress"]
    )
    assert result.exit_code == 2
    assert result.stderr.startswith("error: fp16 needs a CUDA device") and result.stderr.count("\n") == 1


def test_bench_engine_gives_cosyvoice3_its_system_prompt(
    tiny3_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefixes: list[tuple[int, ...]] = []
    add = Engine.add

    def recording_add(self: Engine, spec: GenerationSpec) -> None:
        prefixes.append(spec.lm_prefix_ids)
        add(self, spec)

    monkeypatch.setattr(Engine, "add", recording_add)
    args = ["bench", "engine", "--model-dir", str(tiny3_model_dir), "--tokens", "8", "--concurrency", "1"]
    args += ["--prompt-seconds", "0.4", "--rounds", "1", "--no-progress", "--json", str(tmp_path / "b.json")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    head = tuple(ModelDir.open(tiny3_model_dir).text_tokenizer().encode(system_prompt()))
    assert prefixes and all(prefix[: len(head)] == head for prefix in prefixes)
    assert all(len(prefix) > len(head) for prefix in prefixes)  # the transcript follows
