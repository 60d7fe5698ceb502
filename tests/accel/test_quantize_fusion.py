"""Stacked projections under int8 dynamic quantization: the same logits as torch's
quantization of the separate Linears, from fewer calls; each input row quantized on its
own, so a row's output does not depend on the rows beside it."""

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from cosyserve.accel.quantize import Int8DynamicLinear, ao_quantize_dynamic
from cosyserve.engine.loader import load_model
from cosyserve.models.linear import stacked_linear


def test_a_stacked_linear_computes_its_parts_concatenated() -> None:
    gen = torch.Generator().manual_seed(0)
    parts = [nn.Linear(8, n, bias=bias) for n, bias in ((6, True), (3, True))]
    for part in parts:
        for p in part.parameters():
            p.data = torch.randn(p.shape, generator=gen)
    x = torch.randn(2, 5, 8, generator=gen)
    with torch.inference_mode():
        torch.testing.assert_close(stacked_linear(*parts)(x), torch.cat([p(x) for p in parts], dim=-1))
    unbiased = stacked_linear(nn.Linear(8, 4, bias=False), nn.Linear(8, 4, bias=False))
    assert unbiased.bias is None and unbiased.weight.shape == (8, 8)


@pytest.mark.filterwarnings("ignore:.*deprecated.*")
@pytest.mark.skipif(ao_quantize_dynamic() is None, reason="this torch has no torch.ao dynamic quantization")
def test_int8_stacks_projections_and_matches_separate_quantized_linears(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir, quantize="int8")
    layer = model.lm.qwen.layers[0]
    assert layer.self_attn.qkv_proj is not None and layer.mlp.gate_up_proj is not None
    assert not hasattr(layer.self_attn, "q_proj") and not hasattr(layer.mlp, "gate_proj")
    linears = [m for m in model.lm.qwen.layers.modules() if isinstance(m, Int8DynamicLinear)]
    assert len(linears) == 4 * len(model.lm.qwen.layers)  # the op called directly, not ao's module
    # The reference: the float model's Linears quantized one by one, as torch does.
    reference = load_model(tiny_model_dir).lm
    separate = copy.deepcopy(reference.qwen.layers)
    quantize_dynamic = ao_quantize_dynamic()
    assert quantize_dynamic is not None
    qconfig = torch.ao.quantization.per_channel_dynamic_qconfig
    quantize_dynamic(separate, {nn.Linear: qconfig}, dtype=torch.qint8, inplace=True)
    ao_linear = type(separate[0].self_attn.q_proj)
    for parent in list(separate.modules()):  # each called row by row, as the model's are
        for name, child in list(parent.named_children()):
            if isinstance(child, ao_linear):
                setattr(parent, name, Int8DynamicLinear.from_ao(child))
    reference.qwen.layers = separate
    # The speech head is quantized too (quantize_lm_), as torch quantizes a Linear.
    assert isinstance(model.lm.llm_decoder, Int8DynamicLinear)
    head = nn.Sequential(reference.llm_decoder)
    quantize_dynamic(head, {nn.Linear: qconfig}, dtype=torch.qint8, inplace=True)
    reference.llm_decoder = Int8DynamicLinear.from_ao(head[0])
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, reference.cfg.speech_token_size, (12,), generator=gen)
    with torch.inference_mode():
        embeds = [lm.speech_embedding(tokens)[None] for lm in (model.lm, reference)]
        got, want = (lm.teacher_forced(e)[1] for lm, e in zip((model.lm, reference), embeds, strict=True))
    assert torch.equal(got, want)


@pytest.mark.filterwarnings("ignore:.*deprecated.*")
@pytest.mark.skipif(ao_quantize_dynamic() is None, reason="this torch has no torch.ao dynamic quantization")
def test_int8_rows_are_quantized_alone_whatever_the_batch() -> None:
    gen = torch.Generator().manual_seed(0)
    linear = nn.Linear(64, 48)
    for p in linear.parameters():
        p.data = torch.randn(p.shape, generator=gen) * 0.1
    quantize_dynamic = ao_quantize_dynamic()
    assert quantize_dynamic is not None
    ao = quantize_dynamic(nn.Sequential(linear), {nn.Linear}, dtype=torch.qint8)[0]
    int8 = Int8DynamicLinear.from_ao(ao)
    # Rows of very different magnitudes, one of them all zeros.
    x = torch.randn(6, 64, generator=gen) * torch.tensor([0.01, 0.1, 1.0, 10.0, 100.0, 0.0])[:, None]
    with torch.inference_mode():
        batched = int8(x)
        alone = torch.cat([int8(row[None]) for row in x])
        want = linear(x)
        per_tensor = ao(x)  # torch's op on the whole batch: one scale for every row
    assert torch.equal(batched, alone)
    assert torch.equal(batched[5], linear.bias.detach())
    error = ((batched - want).abs().sum(1) / want.abs().sum(1))[:5]
    assert error.max() < 0.05  # 7-bit activations on each row's own range
    # On one scale the quiet rows lose most of their precision.
    assert ((per_tensor - want).abs().sum(1) / want.abs().sum(1))[:2].min() > 4 * error[:2].max()


@pytest.mark.filterwarnings("ignore:.*deprecated.*")
@pytest.mark.skipif(ao_quantize_dynamic() is None, reason="this torch has no torch.ao dynamic quantization")
@pytest.mark.parametrize(("in_features", "out_features"), [(64, 48), (128, 256), (896, 1152)])
def test_int8_rows_get_the_dynamic_ops_bits_on_the_range_minus_one_to_one(
    in_features: int, out_features: int
) -> None:
    """The fixed input grid (scale 2/127, zero point 64) is what the dynamic op picks when
    its input spans exactly [-1, 1], as a constant row holding -1 and 1 made it do."""
    int8 = int8_linear(in_features, out_features, seed=out_features, std=0.1)
    gen = torch.Generator().manual_seed(out_features)
    ends = torch.zeros(1, in_features)
    ends[0, :2] = torch.tensor([-1.0, 1.0])
    with torch.inference_mode():
        for count in (1, 2, 5, 17):
            magnitudes = 10.0 ** torch.linspace(-2, 2, count)[:, None]
            rows = torch.randn(count, in_features, generator=gen) * magnitudes
            scale = rows.abs().amax(dim=1, keepdim=True)
            spanned = torch.cat([rows / scale, ends])  # the op's range: exactly [-1, 1]
            want = torch.ops.quantized.linear_dynamic(spanned, int8.packed, True)[:-1]
            assert torch.equal(int8(rows), torch.addcmul(int8.bias, want, scale))


def int8_linear(in_features: int, out_features: int, seed: int, std: float) -> Int8DynamicLinear:
    """A random Linear (weights and bias of standard deviation ``std``) quantized as the
    LM's are: int8 weights per output row."""
    gen = torch.Generator().manual_seed(seed)
    linear = nn.Linear(in_features, out_features)
    for p in linear.parameters():
        p.data = torch.randn(p.shape, generator=gen) * std
    quantize_dynamic = ao_quantize_dynamic()
    assert quantize_dynamic is not None
    qconfig = torch.ao.quantization.per_channel_dynamic_qconfig
    quantized = quantize_dynamic(nn.Sequential(linear), {nn.Linear: qconfig})
    assert isinstance(quantized, nn.Sequential)
    return Int8DynamicLinear.from_ao(quantized[0])


# The marks of a test of torch's dynamic int8 Linears (deprecated, and gone from some torch).
DYNAMIC_INT8 = [
    pytest.mark.filterwarnings("ignore:.*deprecated.*"),
    pytest.mark.skipif(
        ao_quantize_dynamic() is None, reason="this torch has no torch.ao dynamic quantization"
    ),
]


def mixed_rows(count: int, width: int, seed: int) -> torch.Tensor:
    """Rows of magnitudes from 0.01 to 100, one of them zero."""
    gen = torch.Generator().manual_seed(seed)
    scales = 10.0 ** torch.linspace(-2, 2, count)
    rows = torch.randn(count, width, generator=gen) * scales[:, None]
    rows[count // 2] = 0
    return rows
