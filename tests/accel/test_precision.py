"""Precision settings: what each loads, that it synthesizes, how close it stays to float32
(on the tiny random model; full-size numbers are in docs/precision.md), and the errors for
settings this machine cannot run."""

import dataclasses
import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from cosyserve.accel import precision, quantize
from cosyserve.accel.machine import Machine
from cosyserve.accel.plan import Choices, choose_plan
from cosyserve.accel.precision import (
    Dtype,
    FlowQuantization,
    Precision,
    PrecisionError,
    Quantization,
    require_torchao,
)
from cosyserve.accel.quantize import (
    Fp16WeightLinear,
    Int8DynamicLinear,
    Int8WeightOnlyLinear,
    int4_group_size,
)
from cosyserve.engine.config import EngineConfig
from cosyserve.engine.loader import LoadedModel, load_model
from cosyserve.errors import CosyserveError
from cosyserve.models.flow.estimator import Estimator
from cosyserve.models.kv_cache import KVCache
from cosyserve.pipeline.request import Mode, SynthesisOptions, SynthesisRequest
from cosyserve.pipeline.synthesizer import Synthesizer
from cosyserve.weights.checkpoint import read_state_dict

CPU_SETTINGS = [("fp32", "none"), ("bf16", "none"), ("fp32", "int8"), ("fp32", "int8wo"), ("bf16", "int8")]
SPEAKER = "中文女"
TOKENS = 20

# Tolerances against float32 on the tiny model, teacher-forced over the fixed sequence
# of _lm_logits (measured values in brackets; full-size numbers in docs/precision.md).
LM_TOLERANCES = {
    # setting: (min top-1 agreement, max |logit error| / fp32 logit std, mean ratio)
    "bf16": (0.90, 0.30, 0.04),  # (0.96, 0.10, 0.012)
    "int8wo": (0.90, 0.45, 0.06),  # (0.96, 0.15, 0.018)
    "int8": (0.70, 1.20, 0.15),  # (0.83, 0.54, 0.071): activations are quantized too
}
FLOW_MEL_TOLERANCE = (0.5, 0.08)  # bf16 flow: max and mean |mel error| (0.16, 0.028)
FLOW_FP16_WEIGHTS_TOLERANCE = (0.01, 0.001)  # fp16 estimator weights (0.0013, 0.00021)


@pytest.fixture(scope="module")
def models(tiny_model_dir: Path) -> dict[str, LoadedModel]:
    """One loaded model per CPU setting, keyed like the benchmark: ``fp32``, ``bf16+int8``."""
    loaded = {}
    for dtype, quant in CPU_SETTINGS:
        key = dtype if quant == "none" else f"{dtype}+{quant}"
        loaded[key] = load_model(tiny_model_dir, dtype=dtype, quantize=quant)
    loaded["fp32+flow-fp16"] = load_model(tiny_model_dir, flow_quantize="fp16")
    return loaded


def _lm_logits(model: LoadedModel) -> torch.Tensor:
    """Teacher-forced speech logits (float32) over a fixed 8 text + 12 prompt + 40 speech
    token sequence, at the positions that predict speech tokens: (53, 6564)."""
    gen = torch.Generator().manual_seed(7)
    lm = model.lm
    device = model.precision.torch_device
    text = torch.randint(0, lm.cfg.qwen.vocab_size, (8,), generator=gen).to(device)
    prompt = torch.randint(0, lm.cfg.speech_token_size, (12,), generator=gen).to(device)
    tokens = torch.randint(0, lm.cfg.speech_token_size, (40,), generator=gen).to(device)
    with torch.inference_mode():
        full = torch.cat([lm.prompt_embeddings(text, prompt), lm.speech_embedding(tokens)])
        _, logits = lm.teacher_forced(full[None])
    return logits[0, 9:].float()


def _flow_mel(model: LoadedModel) -> torch.Tensor:
    gen = torch.Generator().manual_seed(8)
    tokens = torch.randint(0, 6561, (1, 30), generator=gen)
    prompt = torch.randint(0, 6561, (1, 10), generator=gen)
    prompt_mel = torch.randn(1, 20, 80, generator=gen) - 5.0
    embedding = torch.randn(1, 192, generator=gen)
    return model.flow.inference(tokens, prompt, prompt_mel, embedding, streaming=False, finalize=True)


def _vocode(model: LoadedModel, mel: torch.Tensor) -> torch.Tensor:
    wave, _ = model.hift.inference(mel, generator=torch.Generator().manual_seed(0))
    return wave


# -- settings that cannot run here ---------------------------------------------------------


def test_fp16_on_cpu_is_refused_before_anything_is_read(tmp_path: Path) -> None:
    with pytest.raises(PrecisionError, match=r"fp16 needs a CUDA device.*use --dtype bf16") as info:
        load_model(tmp_path / "no-such-model", dtype="fp16")
    assert isinstance(info.value, CosyserveError)
    assert info.value.code == "unsupported_precision"


def test_int4_on_cpu_is_refused_with_the_cpu_alternative() -> None:
    with pytest.raises(PrecisionError, match=r"int4 quantization needs a CUDA device.*--quantize int8"):
        Precision.resolve(quantize="int4")
    with pytest.raises(PrecisionError, match="int4 quantization needs a CUDA device"):
        Precision.resolve(dtype="bf16", quantize=Quantization.INT4)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtype": "fp8"}, "unknown dtype 'fp8'; choose one of: fp32, bf16, fp16"),
        ({"quantize": "int2"}, "unknown quantize 'int2'; choose one of: none, int8, int8wo, int4"),
        ({"device": "mps"}, "device 'mps' is not supported"),
        ({"device": "tpu"}, "unknown device 'tpu'"),
        ({"flow_quantize": "int8"}, "unknown flow_quantize 'int8'; choose one of: none, fp16"),
    ],
)
def test_unknown_settings_name_the_choices(kwargs: dict[str, str], message: str) -> None:
    with pytest.raises(PrecisionError, match=message):
        Precision.resolve(**kwargs)  # type: ignore[arg-type]


def test_compile_is_refused_for_a_quantized_lm() -> None:
    with pytest.raises(PrecisionError, match="compile applies to the unquantized LM"):
        Precision.resolve(quantize="int8", compile=True)


def test_fp16_flow_weights_need_the_float32_cpu_flow(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(PrecisionError, match=r"runs in bf16; use --dtype fp32 or --flow-quantize none"):
        Precision.resolve(dtype="bf16", flow_quantize="fp16")
    with pytest.raises(PrecisionError, match=r"is a CPU setting; on CUDA use --dtype fp16"):
        Precision.resolve(device="cuda", flow_quantize="fp16")
    assert Precision.resolve(quantize="int8", flow_quantize="fp16").flow_quantize is FlowQuantization.FP16
    monkeypatch.setattr(precision, "fbgemm_available", lambda: False)
    with pytest.raises(PrecisionError, match=r"needs torch's fbgemm kernels.*--flow-quantize none"):
        Precision.resolve(flow_quantize="fp16")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_without_a_gpu_is_refused() -> None:
    with pytest.raises(PrecisionError, match=r"CUDA is not available.*--device cpu"):
        Precision.resolve(dtype="bf16", device="cuda")


@pytest.mark.parametrize(
    ("native", "dtype", "warned"), [(False, "bf16", True), (True, "bf16", False), (False, "fp32", False)]
)
def test_bf16_on_a_cpu_without_bf16_instructions_warns(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture, native: bool, dtype: str, warned: bool
) -> None:
    this = Machine.detect()
    machine = dataclasses.replace(this, cpu=dataclasses.replace(this.cpu, bf16=native, amx=False))
    with caplog.at_level(logging.WARNING):
        resolved = Precision.resolve(dtype=dtype)
        plan = choose_plan(machine, "exact", Choices(dtype=dtype))
        assert not caplog.records  # choosing a plan (as `serve` does before it loads) says nothing
        model = load_model(tiny_model_dir, plan)
    assert resolved.dtype == model.precision.dtype == dtype  # still allowed: slow, not wrong
    advice = [r.getMessage() for r in caplog.records if "without bfloat16 instructions" in r.getMessage()]
    assert len(advice) == int(warned)  # once per load
    assert all("--dtype fp32" in line for line in advice)


def test_missing_torchao_gives_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchao", None)  # makes `import torchao` fail
    with pytest.raises(PrecisionError, match=r"pip install 'cosyserve\[cuda\]'"):
        require_torchao()


# -- what each CPU setting loads -----------------------------------------------------------


def test_default_load_is_the_float32_cpu_model(models: dict[str, LoadedModel], tiny_model_dir: Path) -> None:
    model = models["fp32"]
    assert model.precision == Precision() == Precision.resolve()
    for module in (model.lm, model.flow, model.hift):
        assert {(p.dtype, p.device.type) for p in module.parameters()} == {(torch.float32, "cpu")}
    assert all(type(m) is nn.Linear for m in model.lm.qwen.layers.modules() if isinstance(m, nn.Linear))
    # Built on the meta device and filled from llm.pt: every weight is the checkpoint's.
    ckpt = read_state_dict(tiny_model_dir / "llm.pt")
    q_proj = "llm.model.model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(model.lm.qwen.layers[1].self_attn.q_proj.weight, ckpt[q_proj])
    assert torch.equal(model.lm.llm_decoder.bias, ckpt["llm_decoder.bias"])
    assert torch.equal(model.lm.llm_decoder.weight, ckpt["llm_decoder.weight"])
    assert model.lm.llm_decoder.weight.t().is_contiguous()  # laid out for decode steps


def test_bf16_runs_lm_and_flow_in_bf16_and_keeps_hift_float32(models: dict[str, LoadedModel]) -> None:
    model = models["bf16"]
    assert {p.dtype for p in model.lm.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in model.flow.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in model.hift.parameters()} == {torch.float32}
    assert model.precision.kv_cache_dtype == torch.bfloat16


@pytest.mark.parametrize("key", ["fp32+int8", "fp32+int8wo", "bf16+int8"])
def test_int8_quantizes_the_decoder_layers_and_the_dynamic_speech_head(
    models: dict[str, LoadedModel], key: str
) -> None:
    model, ref = models[key], models["fp32"]
    linears = [m for m in model.lm.qwen.layers.modules() if isinstance(m, nn.Linear)]
    assert not linears, "every decoder-layer Linear is replaced"
    if key.endswith("int8wo"):
        assert sum(isinstance(m, Int8WeightOnlyLinear) for m in model.lm.modules()) == 7 * 2
        head = "llm_decoder.weight"
        assert torch.equal(model.lm.get_parameter(head), ref.lm.get_parameter(head))
    else:
        # 4 stacked Linears per layer, and the speech head.
        assert isinstance(model.lm.llm_decoder, Int8DynamicLinear)
        assert sum(isinstance(m, Int8DynamicLinear) for m in model.lm.modules()) == 4 * 2 + 1
    # Activations stay float32 for the CPU int8 kernels; the embeddings are untouched.
    assert model.precision.lm_dtype == model.precision.kv_cache_dtype == torch.float32
    for name in ("qwen.embed_tokens.weight", "speech_embedding.weight"):
        assert torch.equal(model.lm.get_parameter(name), ref.lm.get_parameter(name))
    flow_dtype = torch.bfloat16 if key.startswith("bf16") else torch.float32
    assert model.flow.speaker_proj.weight.dtype == flow_dtype


def test_int8_falls_back_to_weight_only_without_torch_ao(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(quantize, "ao_quantize_dynamic", lambda: None)
    with caplog.at_level(logging.WARNING, logger="cosyserve.accel.quantize"):
        model = load_model(tiny_model_dir, quantize="int8")
    assert isinstance(model.lm.qwen.layers[0].mlp.down_proj, Int8WeightOnlyLinear)
    assert "weight-only int8 instead" in caplog.text


# -- closeness to float32 ------------------------------------------------------------------


@pytest.mark.parametrize("key", ["bf16", "fp32+int8wo", "fp32+int8"])
def test_lm_logits_stay_close_to_float32(models: dict[str, LoadedModel], key: str) -> None:
    ref = _lm_logits(models["fp32"])
    got = _lm_logits(models[key])
    min_agree, max_ratio, mean_ratio = LM_TOLERANCES[key.removeprefix("fp32+")]
    agreement = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    err = (got - ref).abs()
    scale = ref.std().item()
    assert agreement >= min_agree
    assert err.max().item() <= max_ratio * scale
    assert err.mean().item() <= mean_ratio * scale
    assert not torch.equal(got, ref), "the setting must actually change the numerics"


def test_bf16_kv_cache_decoding_matches_the_bf16_full_forward(models: dict[str, LoadedModel]) -> None:
    lm = models["bf16"].lm
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, lm.cfg.speech_token_size, (6,), generator=gen)
    with torch.inference_mode():
        prompt = lm.prompt_embeddings(torch.randint(0, 1000, (5,), generator=gen), tokens[:0])
        full = torch.cat([prompt, lm.speech_embedding(tokens)])
        _, logits = lm.teacher_forced(full[None])
        expected = logits[0, -1].float().log_softmax(-1)
        cache = KVCache.for_config(lm.cfg.qwen, 2, 32, models["bf16"].precision.kv_cache_dtype)
        slot = cache.allocate()
        lm.prefill(full[:-1], slot, cache)
        got = lm.decode(tokens[-1:], [slot], cache)[0]
    assert cache.k.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, atol=0.05, rtol=0)


def test_bf16_flow_mel_stays_close_and_hift_is_untouched(models: dict[str, LoadedModel]) -> None:
    ref_mel = _flow_mel(models["fp32"])
    mel = _flow_mel(models["bf16"])
    assert mel.dtype == torch.float32
    err = (mel - ref_mel).abs()
    assert 0 < err.max().item() <= FLOW_MEL_TOLERANCE[0]
    assert err.mean().item() <= FLOW_MEL_TOLERANCE[1]
    # HiFT stays float32 under bf16: the same mel gives the same waveform, bit for bit.
    with torch.inference_mode():
        assert torch.equal(_vocode(models["bf16"], ref_mel), _vocode(models["fp32"], ref_mel))


def test_int8_weight_only_linear_matches_the_float_layer() -> None:
    gen = torch.Generator().manual_seed(0)
    linear = nn.Linear(96, 40)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(40, 96, generator=gen) / 96**0.5)
    layer = Int8WeightOnlyLinear.from_linear(linear)
    x = torch.randn(3, 5, 96, generator=gen)
    with torch.inference_mode():
        expected, got = linear(x), layer(x)
    assert got.dtype == torch.float32 and got.shape == (3, 5, 40)
    rel = ((got - expected).norm() / expected.norm()).item()
    assert 0 < rel < 0.02
    with torch.inference_mode():
        assert layer(x.bfloat16()).dtype == torch.bfloat16


def test_fp16_weight_linear_is_the_float_layer_with_fp16_rounded_weights() -> None:
    gen = torch.Generator().manual_seed(0)
    linear, plain = nn.Linear(96, 40), nn.Linear(96, 40, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(40, 96, generator=gen) / 96**0.5)
    x = torch.randn(3, 5, 96, generator=gen)
    for layer in (linear, plain):
        fp16 = Fp16WeightLinear(layer)
        with torch.inference_mode():
            got = fp16(x)
            rounded = torch.nn.functional.linear(x, layer.weight.half().float(), layer.bias)
            exact = layer(x)
        assert got.dtype == torch.float32 and got.shape == (3, 5, 40)
        # float32 accumulation: only the weights' rounding separates it from the float layer.
        torch.testing.assert_close(got, rounded, rtol=1e-5, atol=1e-5)
        assert not torch.equal(got, exact)


def test_fp16_flow_weights_replace_only_the_estimator_linears(models: dict[str, LoadedModel]) -> None:
    model, ref = models["fp32+flow-fp16"], models["fp32"]
    assert "flow float32 with fp16 weights" in model.precision.describe()
    estimator = model.flow.cfm.estimator
    assert isinstance(estimator, Estimator)
    assert not any(isinstance(m, nn.Linear) for m in estimator.modules())
    swapped = [m for m in estimator.modules() if isinstance(m, Fp16WeightLinear)]
    assert len(swapped) == sum(isinstance(m, nn.Linear) for m in ref.flow.cfm.estimator.modules()) > 0
    # The encoder, the LM and HiFT keep their float32 Linears.
    assert any(type(m) is nn.Linear for m in model.flow.encoder.modules())
    assert all(type(m) is nn.Linear for m in model.lm.qwen.layers.modules() if isinstance(m, nn.Linear))


def test_fp16_flow_weights_keep_the_mel_close(models: dict[str, LoadedModel]) -> None:
    ref_mel = _flow_mel(models["fp32"])
    mel = _flow_mel(models["fp32+flow-fp16"])
    err = (mel - ref_mel).abs()
    assert mel.dtype == torch.float32
    assert 0 < err.max().item() <= FLOW_FP16_WEIGHTS_TOLERANCE[0]
    assert err.mean().item() <= FLOW_FP16_WEIGHTS_TOLERANCE[1]


def test_int8_weight_only_refuses_widths_its_kernel_cannot_take() -> None:
    # aten._weight_int8pack_mm crashes the process (or answers wrongly) for such widths.
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(40, 64))
    with pytest.raises(PrecisionError, match="divisible by 16, got 40"):
        quantize.int8_weight_only_(model)
    assert all(type(m) is nn.Linear for m in model), "nothing is replaced when any layer is refused"


def test_int4_group_size_divides_every_layer() -> None:
    assert int4_group_size(nn.Sequential(nn.Linear(896, 4864), nn.Linear(4864, 896))) == 128
    assert int4_group_size(nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 64))) == 64
    with pytest.raises(PrecisionError, match="divisible by 32"):
        int4_group_size(nn.Sequential(nn.Linear(40, 8)))


# -- synthesis -----------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["bf16", "fp32+int8", "fp32+int8wo", "fp32+flow-fp16"])
def test_each_cpu_setting_synthesizes(models: dict[str, LoadedModel], key: str) -> None:
    model = models[key]
    config = EngineConfig(max_active=1, dtype=model.precision.kv_cache_dtype)
    synth = Synthesizer(model, config)
    options = SynthesisOptions(seed=0, min_tokens=TOKENS, max_tokens=TOKENS)
    request = SynthesisRequest("你好。", Mode.SFT, voice=synth.speaker(SPEAKER), options=options)
    audio = synth.synthesize(request)
    samples_per_token = model.hparams.flow.token_mel_ratio * model.hparams.hift.upsample_factor
    assert audio.dtype == np.float32
    assert audio.size == TOKENS * samples_per_token
    assert np.isfinite(audio).all() and 0 < np.abs(audio).max() <= model.hparams.hift.audio_limit


@pytest.mark.slow
def test_compiled_lm_matches_eager_at_every_batch_size(
    models: dict[str, LoadedModel], tiny_model_dir: Path
) -> None:
    # Cold inductor compiles take minutes on a loaded 2-core machine: slow suite only.
    compiled = load_model(tiny_model_dir, compile=True)
    graphs_after_warm_up = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    outputs = []
    for lm in (models["fp32"].lm, compiled.lm):
        cache = KVCache.for_config(lm.cfg.qwen, 4, 16, torch.float32)
        slots = [cache.allocate() for _ in range(4)]
        tokens = torch.arange(4) * 100
        with torch.inference_mode():
            for slot in slots:
                lm.prefill(lm.speech_embedding(tokens[: slot + 2]), slot, cache)
            outputs.append([lm.decode(tokens[:b], slots[4 - b :], cache) for b in (1, 3, 4, 2)])
    for eager, got in zip(*outputs, strict=True):
        torch.testing.assert_close(got, eager, atol=1e-4, rtol=0)
    # New batch sizes and slots reuse the warm-up graphs.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs_after_warm_up


@pytest.mark.slow
def test_the_benchmark_runs_and_reports_every_setting(tiny_model_dir: Path, tmp_path: Path) -> None:
    script = Path(__file__).parents[2] / "benchmarks" / "precision_quality.py"
    out = tmp_path / "result.json"
    small = ["--text", "4", "--prompt", "5", "--tokens", "12", "--context", "4", "--steps", "2"]
    settings = "bf16,fp32+int8wo,fp32+flow-fp16"
    command = [sys.executable, str(script), str(tiny_model_dir), "--settings", settings]
    subprocess.run([*command, *small, "--out", str(out)], check=True, capture_output=True)
    results = {r["setting"]: r for r in json.loads(out.read_text())["results"]}
    assert list(results) == ["fp32", "bf16", "fp32+int8wo", "fp32+flow-fp16"]
    assert results["fp32"]["lm_top1_agreement"] == 1.0 and results["fp32"]["flow_mel_max_err"] == 0.0
    assert 0 < results["bf16"]["flow_mel_max_err"] < 1
    assert results["fp32+int8wo"]["flow_mel_max_err"] == 0.0  # the flow is untouched by int8
    assert 0.5 < results["fp32+int8wo"]["lm_top1_agreement"] <= 1.0
    assert results["fp32+flow-fp16"]["lm_top1_agreement"] == 1.0  # the LM is untouched
    assert 0 < results["fp32+flow-fp16"]["flow_mel_max_err"] < results["bf16"]["flow_mel_max_err"]


# -- CUDA (never in CI; run on a GPU machine) ----------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
@pytest.mark.parametrize("dtype", [Dtype.BF16, Dtype.FP16])
def test_cuda_half_precision_loads_and_synthesizes(tiny_model_dir: Path, dtype: Dtype) -> None:
    model = load_model(tiny_model_dir, dtype=dtype, device="cuda")
    assert model.lm.llm_decoder.weight.dtype == dtype.torch_dtype
    assert model.lm.llm_decoder.weight.device.type == "cuda"
    assert model.hift.conv_pre.weight.dtype == torch.float32
    config = EngineConfig(max_active=1, dtype=model.precision.kv_cache_dtype, device="cuda")
    synth = Synthesizer(model, config)
    options = SynthesisOptions(seed=0, min_tokens=TOKENS, max_tokens=TOKENS)
    audio = synth.synthesize(
        SynthesisRequest("你好。", Mode.SFT, voice=synth.speaker(SPEAKER), options=options)
    )
    assert audio.size > 0 and np.isfinite(audio).all()


@needs_cuda
def test_cuda_int8_keeps_logits_close(tiny_model_dir: Path) -> None:
    pytest.importorskip("torchao")
    ref = load_model(tiny_model_dir, dtype="bf16", device="cuda")
    model = load_model(tiny_model_dir, dtype="bf16", quantize=Quantization.INT8, device="cuda")
    assert model.precision.kv_cache_dtype == torch.bfloat16
    ref_logits, logits = _lm_logits(ref).cpu(), _lm_logits(model).cpu()
    agreement = (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item()
    assert agreement >= 0.7


@needs_cuda
@torch.inference_mode()
def test_cuda_int4_is_its_dequantized_weights(tiny_model_dir: Path) -> None:
    """int4 is checked against what it promises, not against bf16's top-1: on the tiny
    model's 64-wide layers a group is a whole row, and random logits have small margins,
    so top-1 agreement with bf16 was 0.38 on an H200 (full-size numbers are in
    docs/precision.md). Every dequantized weight must lie within half a quantization step
    of the original, and the int4 LM's logits must be those of a bf16 LM holding the
    dequantized weights."""
    pytest.importorskip("torchao")
    ref = load_model(tiny_model_dir, dtype="bf16", device="cuda")
    model = load_model(tiny_model_dir, dtype="bf16", quantize=Quantization.INT4, device="cuda")
    group = int4_group_size(ref.lm.qwen.layers)
    quantized = dict(model.lm.qwen.layers.named_modules())
    linears = [(name, m) for name, m in ref.lm.qwen.layers.named_modules() if isinstance(m, nn.Linear)]
    assert linears
    for name, linear in linears:
        out_features, in_features = linear.weight.shape
        eye = torch.eye(in_features, dtype=torch.bfloat16, device="cuda")
        # The kernel applied to the identity gives the weights it computes with: (in, out).
        dequantized = quantized[name](eye).float()
        if linear.bias is not None:
            dequantized -= linear.bias.float()
        dequantized = dequantized.T
        weight = linear.weight.float()
        groups = weight.view(out_features, in_features // group, group)
        step = (groups.amax(-1) - groups.amin(-1)) / 15  # 16 levels per group
        err = (dequantized - weight).abs().view_as(groups).amax(-1)
        # Half a step, plus bfloat16 rounding of the scale and of the result.
        assert (err <= 0.6 * step + groups.abs().amax(-1) / 128).all(), name
        linear.weight.copy_(dequantized.to(torch.bfloat16))
    ref_logits, logits = _lm_logits(ref).cpu(), _lm_logits(model).cpu()
    agreement = (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item()
    err = (logits - ref_logits).abs() / ref_logits.std()
    assert agreement >= 0.9 and err.max() <= 0.3 and err.mean() <= 0.04, (agreement, err.max(), err.mean())
