"""``cosyserve doctor``: the judgement on injected facts, and one real run here."""

import dataclasses
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cosyserve.cli import doctor
from cosyserve.cli.doctor import GIB, Facts, Gpu, Intent, Status, evaluate, exit_code, gpu_memory_needed
from cosyserve.cli.main import app

H100 = Gpu("NVIDIA H100 80GB HBM3", (9, 0), 80 * GIB, 78 * GIB)
T4 = Gpu("Tesla T4", (7, 5), 16 * GIB, 15 * GIB)


@pytest.fixture
def good(tmp_path: Path) -> Facts:
    """A healthy CUDA server: every check OK."""
    return Facts(
        python=(3, 11, 7),
        system="Linux",
        platform="Linux-6.8-x86_64",
        torch_version="2.13.0+cu128",
        torch_cuda="12.8",
        cpu_bf16=True,
        gpus=(H100,),
        cuda_error=None,
        driver_version="570.86.15",
        driver_cuda="12.8",
        onnxruntime_version="1.32.0",
        onnxruntime_providers=("CPUExecutionProvider",),
        av_version="18.1.0",
        unusable_formats=(),
        wetext_error=None,
        model_dir=tmp_path,
        model_error=None,
        model_warning=None,
        model_hashed=True,
        weights_bytes=doctor.OFFICIAL_WEIGHTS,
        disk_free_bytes=100 * GIB,
        ports=(("HTTP", "127.0.0.1", 8000, None), ("gRPC", "127.0.0.1", 50051, None)),
    )


def statuses(facts: Facts, plan: Intent | None = None) -> dict[str, Status]:
    return {check.name: check.status for check in evaluate(facts, plan or Intent())}


def test_a_healthy_gpu_server_is_all_ok(good: Facts) -> None:
    checks = evaluate(good, Intent(device="cuda", dtype="bf16"))
    assert [c.status for c in checks] == [Status.OK] * len(checks), doctor.render(checks)
    assert exit_code(checks) == 0


@pytest.mark.parametrize(
    ("change", "plan", "check", "status"),
    [
        ({"driver_cuda": "11.8"}, Intent(), "driver", Status.FAIL),  # driver too old for the wheel
        ({"driver_cuda": "12.4"}, Intent(), "driver", Status.WARN),  # minor-version compatibility
        ({"gpus": (), "cuda_error": "no driver"}, Intent(device="cuda"), "gpu", Status.FAIL),
        ({"gpus": (), "torch_cuda": None}, Intent(), "gpu", Status.WARN),  # CPU wheel on a GPU box
        ({"gpus": (), "torch_cuda": None, "driver_version": None}, Intent(device="cpu"), "gpu", Status.OK),
        ({"gpus": (T4,)}, Intent(dtype="bf16"), "precision", Status.FAIL),  # no bf16 before Ampere
        ({"gpus": (dataclasses.replace(H100, free_bytes=2 * GIB),)}, Intent(), "precision", Status.FAIL),
        ({"gpus": ()}, Intent(dtype="fp16"), "precision", Status.FAIL),  # fp16 is CUDA only
        ({"gpus": (), "cpu_bf16": False}, Intent(dtype="bf16"), "precision", Status.WARN),  # emulated bf16
        ({"gpus": ()}, Intent(dtype="bf16"), "precision", Status.OK),  # AVX512-BF16 or AMX
        ({"python": (3, 10, 12)}, Intent(), "python", Status.FAIL),
        ({"torch_version": "2.11.0+cu128"}, Intent(), "torch", Status.WARN),
        ({"onnxruntime_providers": ("CUDAExecutionProvider",)}, Intent(), "onnxruntime", Status.FAIL),
        ({"unusable_formats": ("mp3",)}, Intent(), "audio codecs", Status.WARN),
        ({"av_version": None}, Intent(), "audio codecs", Status.FAIL),
        (
            {"wetext_error": "FileNotFoundError: zh_tn_tagger.fst"},
            Intent(),
            "text normalization",
            Status.FAIL,
        ),
        ({"model_error": "llm.pt: missing"}, Intent(), "model directory", Status.FAIL),
        ({"model_warning": "no manifest.sha256"}, Intent(), "model directory", Status.WARN),
        ({"disk_free_bytes": GIB // 2}, Intent(), "disk", Status.WARN),
        (
            {"ports": (("HTTP", "127.0.0.1", 8000, "Address already in use"),)},
            Intent(),
            "HTTP port",
            Status.FAIL,
        ),
    ],
)
def test_each_problem_is_reported(
    good: Facts, change: dict[str, object], plan: Intent, check: str, status: Status
) -> None:
    result = statuses(dataclasses.replace(good, **change), plan)  # type: ignore[arg-type]
    assert result[check] is status
    assert exit_code(evaluate(dataclasses.replace(good, **change), plan)) == (status is Status.FAIL)  # type: ignore[arg-type]
    others = {name: s for name, s in result.items() if name != check}
    assert set(others.values()) <= {Status.OK, Status.WARN}


def test_missing_model_dir_needs_room_for_the_download(good: Facts, tmp_path: Path) -> None:
    facts = dataclasses.replace(
        good, model_dir=tmp_path / "absent", model_error="absent", disk_free_bytes=2 * GIB
    )
    checks = {c.name: c for c in evaluate(facts, Intent())}
    assert checks["disk"].status is Status.FAIL
    assert checks["model directory"].advice == f"`cosyserve download --dir {tmp_path / 'absent'}`"


def test_memory_estimate_shrinks_with_dtype_and_quantization() -> None:
    weights = doctor.OFFICIAL_WEIGHTS
    fp32, bf16 = gpu_memory_needed(weights, Intent()), gpu_memory_needed(weights, Intent(dtype="bf16"))
    int8 = gpu_memory_needed(weights, Intent(dtype="bf16", quantize="int8"))
    assert fp32 > bf16 > int8 > sum(weights) // 4
    assert fp32 - bf16 == pytest.approx((weights[0] + weights[1]) / 2, rel=1e-6)


def test_cli_exits_1_on_a_failed_check(good: Facts, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(doctor, "gather", lambda *a, **k: dataclasses.replace(good, driver_cuda="11.8"))
    result = CliRunner().invoke(app, ["doctor", "--model-dir", str(tmp_path)])
    assert result.exit_code == 1
    assert "FAIL  driver" in result.stdout and "upgrade the driver" in result.stdout
    monkeypatch.setattr(doctor, "gather", lambda *a, **k: good)
    assert CliRunner().invoke(app, ["doctor", "--model-dir", str(tmp_path)]).exit_code == 0


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_real_run_on_this_machine(
    tiny_model_dir: Path, busy_port: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Everything real: the tiny model passes, the listening port fails the run."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    args = ["doctor", "--model-dir", str(tiny_model_dir), "--port", str(busy_port), "--grpc-port", "0"]
    result = CliRunner().invoke(app, args)
    lines = {
        line.split()[1]: line.split()[0] for line in result.stdout.splitlines() if not line.startswith(" ")
    }
    assert result.exit_code == 1, result.stdout
    assert lines["HTTP"] == "FAIL" and lines["model"] == "OK" and lines["text"] == "OK", result.stdout
    assert lines["plan"] in ("OK", "WARN") and "profile auto (" in result.stdout
    assert lines["torch"] in ("OK", "WARN") and lines["gpu"] in ("OK", "WARN")
    assert "gRPC" not in lines


def test_the_plan_heads_the_report_and_sets_the_intent(good: Facts) -> None:
    from cosyserve.accel.machine import Cpu, Machine
    from cosyserve.accel.plan import Choices, choose_plan

    zen4 = Machine(Cpu("Zen 4", 2, avx2=True, avx512=True, vnni=True, bf16=True), fbgemm=True)
    facts = dataclasses.replace(good, gpus=(), plan=choose_plan(zen4, "auto"))
    intent = facts.intent(None, None, None)
    assert intent == Intent("cpu", "bf16", "int8")
    assert facts.intent("cpu", "fp32", None) == Intent("cpu", "fp32", "int8")  # flags win, one each
    checks = evaluate(facts, intent)
    assert checks[0].name == "plan" and checks[0].status is Status.OK
    assert checks[0].detail.startswith(
        "profile auto (measured on avx512_bf16): cpu=avx512_bf16 device=cpu dtype=bf16"
    )
    zen3 = Machine(Cpu("Zen 3", 2, avx2=True), fbgemm=True)
    slow = dataclasses.replace(facts, plan=choose_plan(zen3, "auto", Choices(dtype="bf16")))
    assert statuses(slow)["plan"] is Status.WARN  # emulated bf16, said with the fix
    failed = dataclasses.replace(good, plan_error="device 'cuda' requested, but CUDA is not available")
    plan_check = evaluate(failed, Intent())[0]
    assert (plan_check.name, plan_check.status) == ("plan", Status.FAIL)
    assert "CUDA is not available" in plan_check.detail


def test_a_cosyvoice3_directory_shows_the_plan_its_flow_runs(
    tiny3_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As loading narrows it: CosyVoice 2's traced steps are off for the DiT, its fp16
    weights stay."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    args = ["doctor", "--model-dir", str(tiny3_model_dir), "--port", "0", "--grpc-port", "0"]
    args += ["--flow-quantize", "fp16"]
    result = CliRunner().invoke(app, args)
    plan = next(line for line in result.stdout.splitlines() if line.split()[1:2] == ["plan"])
    assert "flow_quantize=fp16" in plan and "traced_flow=off" in plan, result.stdout
