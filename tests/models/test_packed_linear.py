"""bfloat16 Linears packed for oneDNN: the same outputs as ``F.linear``, swapped in for the
bf16 flow estimator's Linears at load, and nothing swapped where the ops are missing."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cosyserve.engine import loader
from cosyserve.engine.loader import load_model
from cosyserve.models import packed_linear
from cosyserve.models.flow.flow import Flow
from cosyserve.models.packed_linear import PackedLinear, pack_linears_, packing_available

needs_packing = pytest.mark.skipif(not packing_available(), reason="no oneDNN bf16 matmul on this CPU")


def _flow_mel(flow: Flow, streaming: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 6561, (1, 30), generator=gen)
    prompt = torch.randint(0, 6561, (1, 10), generator=gen)
    prompt_mel = torch.randn(1, 20, 80, generator=gen) - 5.0
    embedding = torch.randn(1, 192, generator=gen)
    return flow.inference(tokens, prompt, prompt_mel, embedding, streaming=streaming, finalize=True)


@needs_packing
@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_gives_f_linear_bit_for_bit(bias: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    linear = nn.Linear(96, 40, bias=bias).to(torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(40, 96, generator=gen))
    packed = PackedLinear(linear)
    cases = [
        torch.randn(20, 96, generator=gen),  # a stream chunk's rows
        torch.randn(2, 450, 96, generator=gen),  # a non-streaming pass, batched
        torch.randn(2, 96, 7, generator=gen).transpose(1, 2),  # a strided view
    ]
    with torch.inference_mode():
        for x in cases:
            x = x.to(torch.bfloat16)
            got = packed(x)
            assert got.dtype == torch.bfloat16 and got.shape == (*x.shape[:-1], 40)
            # F.linear takes another path for a strided view (its result differs in the last
            # bits from its own on the contiguous copy); the packed call does not.
            assert torch.equal(got, F.linear(x.contiguous(), linear.weight, linear.bias))


@needs_packing
def test_packed_gelu_rounds_the_gelu_of_the_float32_sums_once() -> None:
    """The fused GELU is the two-step ``F.gelu(packed(x))`` without its middle rounding: within
    a bfloat16 step of the GELU of float32 sums, and no farther from float64 on average."""
    gen = torch.Generator().manual_seed(1)
    linear = nn.Linear(256, 1024).to(torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(1024, 256, generator=gen) * 0.06)
        linear.bias.copy_(torch.randn(1024, generator=gen) * 0.1)
    packed = PackedLinear(linear)
    x = torch.randn(2, 450, 256, generator=gen).to(torch.bfloat16)
    w, b = linear.weight.double(), linear.bias.double()
    exact = F.gelu(F.linear(x.double(), w, b))
    with torch.inference_mode():
        fused = packed.gelu(x)
        two_step = F.gelu(packed(x))
    assert fused.dtype == torch.bfloat16 and fused.shape == (2, 450, 1024)
    assert not torch.equal(fused, two_step)  # the rounding in between is gone
    step = exact.abs().clamp_min(1e-3) * 2.0**-7  # a bfloat16 step
    assert bool(((fused.double() - exact).abs() <= step).all())
    assert (fused.double() - exact).abs().mean() <= (two_step.double() - exact).abs().mean()


def test_packed_linear_refuses_other_dtypes() -> None:
    with pytest.raises(ValueError, match=r"takes a bfloat16 CPU Linear, not torch\.float32"):
        PackedLinear(nn.Linear(8, 8))


@needs_packing
def test_pack_linears_swaps_only_bf16_linears() -> None:
    inner = nn.Sequential(nn.Linear(16, 16).bfloat16())
    model = nn.Sequential(nn.Linear(16, 16).bfloat16(), inner, nn.Linear(16, 4))
    assert pack_linears_(model) == 2
    assert isinstance(model[0], PackedLinear) and isinstance(inner[0], PackedLinear)
    assert type(model[2]) is nn.Linear


def test_pack_linears_changes_nothing_without_the_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(packed_linear, "packing_available", lambda: False)
    model = nn.Sequential(nn.Linear(16, 16).bfloat16())
    assert pack_linears_(model) == 0
    assert type(model[0]) is nn.Linear


@needs_packing
def test_bf16_flow_estimator_is_packed_and_computes_the_same_mel(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    packed = load_model(tiny_model_dir, dtype="bf16").flow
    # The plain flow keeps packed convolutions (tests/models/flow/test_blocks.py has them
    # against the product over the frames' windows): only its Linears differ.
    monkeypatch.setattr(loader, "pack_linears_", lambda module: 0)
    plain = load_model(tiny_model_dir, dtype="bf16").flow
    estimator = packed.cfm.estimator
    assert not any(isinstance(m, nn.Linear) for m in estimator.modules())
    linears = [m for name, m in estimator.named_modules() if not name.endswith(".gemm")]  # not the convs'
    swapped = sum(isinstance(m, PackedLinear) for m in linears)
    assert swapped == sum(isinstance(m, nn.Linear) for m in plain.cfm.estimator.modules()) > 0
    # Every convolution has its matrix packed too, which it runs every input through.
    convs = [m for m in estimator.modules() if isinstance(m, nn.Conv1d)]
    assert convs and all(isinstance(getattr(m, "gemm", None), PackedLinear) for m in convs)
    # The encoder keeps its Linears: it runs once per chunk, not once per Euler step.
    assert any(type(m) is nn.Linear for m in packed.encoder.modules())
    with torch.inference_mode():
        fused = {streaming: _flow_mel(packed, streaming) for streaming in (False, True)}
        # The same bits once the feed-forward rounds before its GELU, as F.gelu(F.linear) does.
        monkeypatch.setattr(PackedLinear, "gelu", lambda self, x: F.gelu(self(x)))
        for streaming in (False, True):
            want = _flow_mel(plain, streaming)
            assert torch.equal(_flow_mel(packed, streaming), want)
            # Fused, the mel moves by bfloat16 noise only.
            assert not torch.equal(fused[streaming], want)
            assert (fused[streaming] - want).abs().mean() < 0.02 * want.abs().mean()


def test_float32_flow_is_not_packed(tiny_model_dir: Path) -> None:
    flow = load_model(tiny_model_dir).flow
    assert not any(isinstance(m, PackedLinear) for m in flow.modules())
