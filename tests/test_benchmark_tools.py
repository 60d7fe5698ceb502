"""The measuring helpers of ``benchmarks/roofline.py`` and ``benchmarks/op_profile.py``, and
that ``benchmarks/flow_weights.py``, ``benchmarks/engine_ab.py``,
``benchmarks/load_memory.py``, ``benchmarks/traced_decode.py``, ``benchmarks/traced_flow.py``,
``benchmarks/int8_kernels.py``, ``benchmarks/native_int8.py`` and ``benchmarks/concurrency_bits.py`` run."""

import importlib
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cosyserve.accel import native_int8
from cosyserve.models.packed_linear import PackedLinear, packing_available

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"


@pytest.fixture
def scripts(monkeypatch: pytest.MonkeyPatch) -> tuple[ModuleType, ModuleType]:
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # as when they run as scripts
    return importlib.import_module("roofline"), importlib.import_module("op_profile")


def test_attention_flops_are_counted_on_cpu(scripts: tuple[ModuleType, ModuleType]) -> None:
    # torch's counter has no formula for the CPU flash kernel, which made the flow's
    # attention (469 of its 1684 GFLOP) count as 0 in docs/benchmarks.md until 2026-12-03.
    roofline, _ = scripts
    b, h, t, s, d = 2, 4, 10, 30, 16
    q, k = torch.randn(b, h, t, d), torch.randn(b, h, s, d)
    counts = roofline.flop_counts(lambda: F.scaled_dot_product_attention(q, k, k))
    assert sum(counts.values()) == 2 * (2 * b * h * t * s * d)  # q·kᵀ and the weights · v


@pytest.mark.skipif(not packing_available(), reason="oneDNN runs no bfloat16 matmul on this CPU")
def test_packed_bf16_linears_are_counted(scripts: tuple[ModuleType, ModuleType]) -> None:
    # torch's counter has no formula for mkldnn._linear_pointwise: the bf16 flow's Linears,
    # most of its FLOPs, counted as 0 in the op profile until 2026-12-06.
    roofline, _ = scripts
    packed = PackedLinear(nn.Linear(128, 256, dtype=torch.bfloat16))
    x = torch.randn(2, 5, 128, dtype=torch.bfloat16)
    counts = roofline.flop_counts(lambda: (packed(x), packed.gelu(x)))
    assert sum(counts.values()) == 2 * (2 * 10 * 128 * 256)


def test_profile_rows_split_time_by_kind_of_op(scripts: tuple[ModuleType, ModuleType]) -> None:
    _, op_profile = scripts
    x, w = torch.randn(64, 128), torch.randn(256, 128)
    scores = torch.randn(4, 32, 32)

    def work() -> None:
        F.linear(x, w).softmax(-1)
        torch.bmm(scores, scores)
        torch.cat([x, x]).add_(1.0)

    result = op_profile.measure(op_profile.Workload("toy", work, "fp32"), repeats=2)
    rows = result["rows"]
    assert rows["matmul (Linear)"]["flops"] == 2 * 64 * 128 * 256
    assert rows["matmul (batched: attention)"]["flops"] == 2 * 4 * 32 * 32 * 32
    assert {"softmax", "copy, cat", "other ops", "outside ops"} <= set(rows)
    assert sum(row["ms"] for row in rows.values()) == pytest.approx(1e3 * result["profiled_wall_s"])
    rated = op_profile._with_rates(rows, peak_gflops=100.0)["matmul (Linear)"]
    assert rated["gflops_per_s"] == pytest.approx(rated["flops"] / rated["ms"] / 1e6)


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("aten::mm", "matmul (Linear)"),
        ("aten.addmm", "matmul (Linear)"),
        ("aten::bmm", "matmul (batched: attention)"),
        ("aten::baddbmm", "matmul (batched: attention)"),
        ("mkldnn::_linear_pointwise", "matmul (Linear)"),
        ("mkldnn._linear_pointwise", "matmul (Linear)"),
        ("quantized::linear_dynamic", "int8 Linear"),
        ("quantized::linear_with_input_q_dq_qweight_dequant_output_fp32", "int8 Linear"),
        ("onednn::qlinear_pointwise", "int8 Linear"),
        ("aten::_softmax", "softmax"),
        ("aten::mkldnn_convolution", "convolution"),
        ("aten.convolution", "convolution"),
        ("aten::copy_", "copy, cat"),
        ("aten::gelu", "other ops"),
    ],
)
def test_profiler_and_counter_names_map_to_the_same_kinds(
    scripts: tuple[ModuleType, ModuleType], name: str, kind: str
) -> None:
    _, op_profile = scripts
    assert op_profile._kind(name) == kind


@pytest.mark.slow
def test_the_op_profile_runs_on_a_model_directory(tiny_model_dir: Path, tmp_path: Path) -> None:
    args = ("--prompt", "25", "--tokens", "30", "--repeats", "1")
    report = _run_script("op_profile.py", tiny_model_dir, tmp_path, *args)
    assert len(report["workloads"]) == 4
    flow = report["workloads"]["flow, non-streaming"]["rows"]
    assert flow["matmul (Linear)"]["flops"] > 0 and flow["matmul (batched: attention)"]["flops"] > 0


def test_flow_weights_compares_every_variant(tiny_model_dir: Path, tmp_path: Path) -> None:
    args = ("--prompt", "10", "--tokens", "20", "--repeats", "2")
    report = _run_script("flow_weights.py", tiny_model_dir, tmp_path, *args)
    summary = report["summary"]
    assert list(summary) == ["conv", "fp32", "fp16"]
    assert len(report["runs"]["fp16"]["first"]) == 2 and len(report["runs"]["fp16"]["full"]) == 1
    assert summary["conv"]["first_mel_max_abs_diff"] == 0.0
    for work in ("first", "full"):
        assert summary["fp32"][f"{work}_mel_max_abs_diff"] < 1e-4  # the same sums, reordered
        assert 0 < summary["fp16"][f"{work}_mel_max_abs_diff"] < 0.01


@pytest.mark.skipif(not packing_available(), reason="no oneDNN bf16 matmul on this CPU")
def test_flow_weights_packed_bf16_differs_by_rounding_only(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Packed, the feed-forwards apply their GELU before rounding (``PackedLinear.gelu``):
    the mel differs from ``F.linear``'s by bfloat16 rounding (mel std about 1.3)."""
    args = ("--prompt", "10", "--tokens", "20", "--repeats", "1", "--variants", "bf16,bf16-packed")
    summary = _run_script("flow_weights.py", tiny_model_dir, tmp_path, *args)["summary"]
    assert list(summary) == ["bf16", "bf16-packed"]
    for work in ("first", "full"):
        assert 0 < summary["bf16-packed"][f"{work}_mel_mean_abs_diff"] < 0.02
        assert summary["bf16-packed"][f"{work}_mel_max_abs_diff"] < 0.25
        assert summary["bf16-packed"][f"{work}_median_wall_s"] > 0


def test_engine_ab_takes_turns_between_two_settings(tiny_model_dir: Path, tmp_path: Path) -> None:
    args = ("--tokens", "10", "--rounds", "1", "--turns", "2", "--flow-prompt-whole")
    report = _run_script("engine_ab.py", tiny_model_dir, tmp_path, *args)
    assert list(report["turns"]) == ["fp32+int8", "fp32+int8+flow-fp16"]
    for rows in report["turns"].values():
        assert len(rows) == 2
        assert all(0 < row["first_chunk_p50_s"] <= row["total_p50_s"] for row in rows)
        assert all(row["stage_s"]["flow"] > 0 for row in rows)
    assert set(report["summary"]) == set(report["turns"])


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


def test_traced_decode_replays_the_eager_steps(tiny_model_dir: Path, tmp_path: Path) -> None:
    args = ("--dtype", "fp32", "--quantize", "int8", "--max-active", "8", "--rounds", "4")
    report = _run_script("traced_decode.py", tiny_model_dir, tmp_path, *args)
    assert report["traces"] == 2 and report["capture_s"] > 0
    assert report["rss_after_capture_mib"] > 0
    for batch in ("batch_1", "batch_8"):
        assert report[batch]["eager_ms"] > 0 and report[batch]["traced_ms"] > 0
        assert report[batch]["max_log_prob_difference"] == 0.0


def test_concurrency_bits_finds_each_requests_tokens_the_same(tiny_model_dir: Path, tmp_path: Path) -> None:
    args = ("--dtype", "fp32", "--quantize", "int8", "--requests", "4")
    report = _run_script("concurrency_bits.py", tiny_model_dir, tmp_path, *args)
    assert report["same_tokens"] == 4
    assert [row["tokens"] for row in report["requests"]] == [12, 14, 16, 18]
    assert all(row["max_audio_difference"] <= 1e-4 for row in report["requests"])


def _run_script(name: str, model_dir: Path, tmp_path: Path, *args: str) -> Any:
    """Run ``benchmarks/<name>`` on ``model_dir`` with ``args``; the JSON report it wrote."""
    out = tmp_path / "report.json"
    command = [sys.executable, str(BENCHMARKS / name), "--model-dir", str(model_dir), *args]
    subprocess.run([*command, "--json", str(out)], check=True, capture_output=True)
    return json.loads(out.read_text())


def test_traced_flow_replays_the_eager_calls(tiny_model_dir: Path, tmp_path: Path) -> None:
    args = ("--dtype", "fp32", "--quantize", "none", "--prompt", "30", "--tokens", "60", "--rounds", "3")
    report = _run_script("traced_flow.py", tiny_model_dir, tmp_path, *args)
    assert report["traced"] and report["capture_s"] > 0 and report["rss_after_capture_mib"] > 0
    assert report["traces"] == 5  # float32: convolutions as products or not
    assert report["first_chunk"]["chunks"] == 1 and report["stream"]["chunks"] > 1
    assert report["non_streaming"]["chunks"] == 1
    for label in ("first_chunk", "stream", "non_streaming"):
        assert report[label]["eager_s"] > 0 and report[label]["traced_s"] > 0
        assert report[label]["max_mel_difference"] == 0.0


def test_int8_kernels_compares_fbgemm_and_onednn(tiny_model_dir: Path, tmp_path: Path) -> None:
    report = _run_script("int8_kernels.py", tiny_model_dir, tmp_path, "--dtype", "fp32", "--rows", "1,16,40")
    assert report["linears"] == 8  # 2 layers x (q/k/v, output, gate/up, down)
    if not torch.cpu._is_amx_tile_supported():
        assert report["on_onednn"] == 0
        return
    assert report["on_onednn"] == 8 and report["onednn_weights_mib"] > 0
    assert report["min_rows"] == [4, 8, 16]  # the tiny shapes' small products
    for rows in ("rows_1", "rows_16", "rows_40"):
        assert report[rows]["fbgemm_ms"] > 0 and report[rows]["onednn_ms"] > 0
    assert not report["rows_1"]["onednn_in_the_model"]
    assert report["rows_16"]["same_bits"] and report["rows_40"]["same_bits"]


def test_native_int8_compares_the_kernel_with_fbgemm(tiny_model_dir: Path, tmp_path: Path) -> None:
    if not native_int8.supported():
        pytest.skip("the int8 kernel runs only on CPUs with AVX-512 VNNI")
    args = ("--dtype", "fp32", "--rows", "1,13", "--batches", "1,3", "--rounds", "4")
    report = _run_script("native_int8.py", tiny_model_dir, tmp_path, *args)
    assert report["linears"] == 9  # 2 layers x (q/k/v, output, gate/up, down), and the head
    for key in ("linears_rows_1", "linears_rows_13", "decode_batch_1", "decode_batch_3"):
        assert report[key]["native_ms"] > 0 and report[key]["fbgemm_ms"] > 0
        assert report[key]["same_bits"], key
