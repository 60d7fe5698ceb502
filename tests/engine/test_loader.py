"""``engine_config_for``: the engine's KV cache follows the loaded model's precision, its
streaming flow mode the model's device, and its decode steps are traced unless the LM is
compiled; loading leaves no tensor unloaded."""

import dataclasses
from pathlib import Path

import pytest
import torch

from cosyserve.accel.machine import Machine
from cosyserve.accel.plan import Choices, choose_plan
from cosyserve.engine.loader import engine_config_for, load_model
from cosyserve.pipeline.synthesizer import Synthesizer


@pytest.mark.parametrize(
    ("dtype", "quantize", "kv_dtype"),
    [
        ("fp32", "none", torch.float32),
        ("bf16", "none", torch.bfloat16),
        # int8 on CPU keeps the LM's activations (and so its keys and values) in float32.
        ("bf16", "int8", torch.float32),
    ],
)
def test_kv_cache_follows_the_precision(
    tiny_model_dir: Path, dtype: str, quantize: str, kv_dtype: torch.dtype
) -> None:
    model = load_model(tiny_model_dir, dtype=dtype, quantize=quantize)
    config = engine_config_for(model, max_active=3, flow_cache="exact")
    assert (config.dtype, config.device, config.max_active, config.flow_cache) == (
        kv_dtype,
        "cpu",
        3,
        "exact",
    )
    engine = Synthesizer(model).engine  # the synthesizer's default engine uses it too
    assert engine.lm_runner.cache.k.dtype == engine.lm_runner.cache.v.dtype == kv_dtype
    assert engine.prefix_cache is not None and engine.prefix_cache.k.dtype == kv_dtype


def test_the_engine_takes_the_plans_flow_cache(tiny_model_dir: Path) -> None:
    exact = load_model(tiny_model_dir)  # load_model's default plan: the exact profile
    assert engine_config_for(exact).flow_cache == "cached"
    fast = dataclasses.replace(exact, plan=choose_plan(Machine.detect(), "fast", Choices(quantize="none")))
    assert engine_config_for(fast).flow_cache == "incremental"
    assert engine_config_for(fast, flow_cache="exact").flow_cache == "exact"  # an override wins


def test_a_compiled_lm_is_not_traced(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir)
    assert engine_config_for(model).traced_decode  # the default
    # As if loaded with compile=True (compiling takes minutes; the slow suite does it).
    plan = choose_plan(Machine.detect(), "exact", Choices(compile=True))
    compiled = dataclasses.replace(model, plan=plan)
    assert not engine_config_for(compiled).traced_decode
    assert not engine_config_for(compiled, traced_decode=True).traced_decode


def test_the_precision_fields_cannot_be_overridden(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir, dtype="bf16")
    with pytest.raises(TypeError, match="dtype"):
        engine_config_for(model, dtype=torch.float32)


@pytest.mark.parametrize(("dtype", "quantize"), [("fp32", "none"), ("bf16", "int8")])
def test_every_weight_is_loaded_in_its_dtype(tiny_model_dir: Path, dtype: str, quantize: str) -> None:
    # The LM and the flow are built on the meta device: a tensor loading missed would stay there.
    model = load_model(tiny_model_dir, dtype=dtype, quantize=quantize)
    for module in (model.lm, model.flow, model.hift):
        tensors = [*module.parameters(), *module.buffers()]
        assert tensors and all(t.device.type == "cpu" for t in tensors)
    flow_dtype = model.precision.flow_dtype
    assert {p.dtype for p in model.flow.parameters()} == {flow_dtype}
    assert model.flow.cfm.noise.dtype == flow_dtype
