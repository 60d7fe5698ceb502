"""The plan: one choice per profile and machine, explicit choices on top, applied by the loader."""

import dataclasses
from pathlib import Path

import pytest
import torch

from cosyserve.accel.machine import Cpu, CpuKind, CudaDevice, Machine
from cosyserve.accel.plan import Choices, DecodeCapture, Plan, Profile, choose_plan
from cosyserve.accel.precision import PrecisionError
from cosyserve.accel.precision_choices import Dtype, FlowQuantization, Quantization
from cosyserve.accel.quantize import Fp16WeightLinear, Int8DynamicLinear
from cosyserve.engine.loader import engine_config_for, load_model

ZEN3 = Machine(Cpu("AMD EPYC (Zen 3)", 2, avx2=True), fbgemm=True)
XEON_VNNI = Machine(Cpu("Xeon (Cascade Lake)", 2, avx2=True, avx512=True, vnni=True), fbgemm=True)
ZEN4 = Machine(
    Cpu("AMD EPYC (Zen 4)", 2, avx2=True, avx512=True, vnni=True, bf16=True), fbgemm=True, mkldnn_bf16=True
)
XEON_AMX = Machine(
    Cpu("Xeon (Sapphire Rapids)", 2, avx2=True, avx512=True, vnni=True, bf16=True, amx=True),
    fbgemm=True,
    mkldnn_bf16=True,
)
ARM = Machine(Cpu("Neoverse", 4))


def _precision(plan: Plan) -> tuple[Dtype, Quantization, FlowQuantization]:
    p = plan.precision
    return p.dtype, p.quantize, p.flow_quantize


@pytest.mark.parametrize(
    ("machine", "kind", "precision"),
    [
        (ZEN3, CpuKind.AVX2, (Dtype.FP32, Quantization.INT8, FlowQuantization.FP16)),
        (XEON_VNNI, CpuKind.AVX512_VNNI, (Dtype.FP32, Quantization.INT8, FlowQuantization.FP16)),
        (ZEN4, CpuKind.AVX512_BF16, (Dtype.BF16, Quantization.INT8, FlowQuantization.NONE)),
        (XEON_AMX, CpuKind.AMX, (Dtype.BF16, Quantization.INT8, FlowQuantization.NONE)),
    ],
)
def test_auto_is_the_measured_fast_plan_of_each_cpu_kind(
    machine: Machine, kind: CpuKind, precision: tuple[Dtype, Quantization, FlowQuantization]
) -> None:
    assert machine.cpu.kind is kind
    plan = choose_plan(machine, "auto", threads=2)
    assert dataclasses.replace(plan, profile=Profile.FAST) == choose_plan(machine, "fast", threads=2)
    assert _precision(plan) == precision
    assert plan.basis == f"measured on {kind}"
    assert plan.precision.device == "cpu" and plan.decode_capture is DecodeCapture.TRACE
    assert plan.flow_cache == "incremental" and plan.traced_flow and plan.flow_prompt_whole
    assert plan.first_hop == 5 and not plan.hop_growth
    # The kernels follow the instructions: ours on VNNI, oneDNN's with AMX, packed bf16 where
    # oneDNN runs bf16 natively, the fused bf16 attention with AMX tiles.
    assert plan.native_int8 == machine.cpu.vnni
    assert plan.onednn_int8 == machine.cpu.amx
    assert plan.packed_bf16 == (precision[0] is Dtype.BF16)
    assert plan.fused_bf16_attention == machine.cpu.amx
    # A float32 flow's streams hold their caches in int8 (a bf16 flow's as computed).
    assert plan.flow_cache_dtype == ("int8" if precision[0] is Dtype.FP32 else "computed")
    assert plan.warnings == ()


@pytest.mark.parametrize("machine", [ZEN3, XEON_VNNI, ZEN4, XEON_AMX, ARM])
def test_exact_is_float32_with_upstreams_schedule_everywhere(machine: Machine) -> None:
    plan = choose_plan(machine, "exact")
    assert _precision(plan) == (Dtype.FP32, Quantization.NONE, FlowQuantization.NONE)
    assert plan.flow_cache == "cached"  # upstream's output, intermediate chunks from the cache
    assert plan.first_hop is None and plan.hop_growth and not plan.flow_prompt_whole
    assert not (plan.native_int8 or plan.onednn_int8 or plan.packed_bf16 or plan.fused_bf16_attention)
    assert plan.flow_cache_dtype == "computed"


def test_a_cpu_without_a_measured_plan_gets_the_safe_plan_under_auto() -> None:
    auto = choose_plan(ARM, "auto")
    assert _precision(auto) == (Dtype.FP32, Quantization.NONE, FlowQuantization.NONE)
    assert auto.basis.startswith("safe: no measured plan for other")
    assert auto.first_hop is None and not auto.flow_prompt_whole and not auto.hop_growth
    fast = choose_plan(ARM, "fast")  # asked for speed: float32, but the short first hop
    assert _precision(fast) == _precision(auto) and fast.first_hop == 5
    assert fast.flow_cache_dtype == "int8" and auto.flow_cache_dtype == "computed"


def test_a_torch_without_fbgemm_has_no_measured_cpu_plan() -> None:
    plan = choose_plan(dataclasses.replace(ZEN3, fbgemm=False), "auto")
    assert plan.basis.startswith("safe") and plan.precision.quantize is Quantization.NONE


def test_explicit_choices_override_one_field_each() -> None:
    plan = choose_plan(ZEN4, "auto", Choices(quantize="none"))
    assert _precision(plan) == (Dtype.BF16, Quantization.NONE, FlowQuantization.NONE)
    assert not plan.native_int8 and plan.packed_bf16
    plan = choose_plan(ZEN3, "exact", Choices(quantize="int8"))
    assert _precision(plan) == (Dtype.FP32, Quantization.INT8, FlowQuantization.NONE)
    assert plan.flow_cache == "cached" and plan.hop_growth


def test_a_profile_choice_yields_to_an_explicit_one_it_cannot_run_with() -> None:
    # fp16 flow weights are a float32 flow's: an explicit bf16 drops them, with a warning
    # that bf16 is emulated on this CPU.
    plan = choose_plan(ZEN3, "auto", Choices(dtype="bf16"))
    assert _precision(plan) == (Dtype.BF16, Quantization.INT8, FlowQuantization.NONE)
    assert len(plan.warnings) == 1 and "--dtype fp32 --flow-quantize fp16" in plan.warnings[0]
    # Asked for explicitly, the conflict is an error naming the fix.
    with pytest.raises(PrecisionError, match="--dtype fp32"):
        choose_plan(ZEN3, "auto", Choices(dtype="bf16", flow_quantize="fp16"))


def test_impossible_choices_fail_with_what_to_use_instead() -> None:
    with pytest.raises(PrecisionError, match="CUDA is not available"):
        choose_plan(ZEN3, "auto", Choices(device="cuda"))
    with pytest.raises(PrecisionError, match="on CPU use"):
        choose_plan(ZEN3, "auto", Choices(dtype="fp16"))
    with pytest.raises(ValueError, match="fastest"):
        choose_plan(ZEN3, "fastest")


def test_a_gpu_machine_plans_for_its_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA by default when there is a device (the device checks are the GPU run's to test:
    here CUDA is made to look available so that the choice itself is tested)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    gpu = dataclasses.replace(ZEN3, cuda=(CudaDevice(0, "NVIDIA H100", 80 << 30, bf16=True),))
    plan = choose_plan(gpu, "auto")
    assert plan.precision.device == "cuda:0" and plan.basis == "measured on cuda"
    assert _precision(plan) == (Dtype.BF16, Quantization.NONE, FlowQuantization.NONE)
    assert plan.decode_capture is DecodeCapture.CUDA_GRAPHS and plan.flow_cache == "exact"
    assert not plan.traced_flow and not plan.flow_prompt_whole and plan.first_hop == 5
    assert plan.flow_cache_dtype == "computed"
    on_cpu = choose_plan(gpu, "auto", Choices(device="cpu"))
    assert on_cpu.precision.device == "cpu" and _precision(on_cpu)[2] is FlowQuantization.FP16


def test_the_plan_is_one_line_and_text_labels() -> None:
    plan = choose_plan(ZEN3, "auto", threads=2)
    line = plan.describe()
    assert "\n" not in line and line.startswith(
        "profile auto (measured on avx2): cpu=avx2 device=cpu dtype=fp32"
    )
    labels = plan.labels()
    assert all(isinstance(v, str) for v in labels.values())
    assert labels["int8_kernel"] == "fbgemm" and labels["first_hop"] == "5" and labels["threads"] == "2"
    assert choose_plan(XEON_AMX, "auto").labels()["int8_kernel"] == "native+onednn"


def test_this_machine_is_detected_consistently() -> None:
    machine = Machine.detect()
    cpu = machine.cpu
    assert cpu.cores >= 1 and cpu.name
    assert not (cpu.vnni and not cpu.avx512)  # VNNI here means the AVX-512 kind
    assert machine.describe().startswith(cpu.name)
    choose_plan(machine, "auto")  # every profile resolves on the machine that runs the tests
    choose_plan(machine, "exact")


def test_the_loader_applies_the_plan(tiny_model_dir: Path) -> None:
    plan = choose_plan(dataclasses.replace(ZEN3, mkldnn_bf16=False), "fast")
    model = load_model(tiny_model_dir, plan)
    assert model.plan is plan and model.precision is plan.precision
    assert any(isinstance(m, Int8DynamicLinear) for m in model.lm.modules())
    assert any(isinstance(m, Fp16WeightLinear) for m in model.flow.cfm.estimator.modules())
    config = engine_config_for(model, max_active=3)
    assert (config.max_active, config.first_hop, config.hop_growth) == (3, 5, False)
    assert (config.flow_cache, config.flow_prompt_whole, config.traced_decode) == ("incremental", True, True)
    # No prompt cache, no whole-prompt priming (it needs one).
    assert not engine_config_for(model, flow_prompt_cache_mb=0).flow_prompt_whole


def test_the_loader_takes_choices_or_a_plan_not_both(tiny_model_dir: Path) -> None:
    with pytest.raises(TypeError, match="not both"):
        load_model(tiny_model_dir, choose_plan(ZEN3, "exact"), dtype="bf16")
