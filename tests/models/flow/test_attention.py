"""The flow's attention: torch's fused kernel in float32 and on CPUs with AMX, GEMMs and a
softmax in bfloat16 on other CPUs, with the same results within bfloat16's rounding. Tests
of the split kernel force it (``split``), whatever this machine's CPU."""

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from cosyserve.models.flow import Flow, attention, blocks
from cosyserve.models.flow.attention import attention as flow_attention


def _qkv(dtype: torch.dtype, queries: int, keys: int, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, queries, 16, generator=gen)
    k = torch.randn(2, 4, keys, 16, generator=gen)
    v = torch.randn(2, 4, keys, 16, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _exact(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, scale: float) -> Tensor:
    """float64 attention of the given (already rounded) inputs."""
    scores = q.double() @ k.double().transpose(-2, -1) * scale
    if bias is not None:
        scores = scores + bias.double()
    return torch.softmax(scores, dim=-1) @ v.double()


def _causal_bias(queries: int, keys: int, dtype: torch.dtype, hidden: float = -1e10) -> Tensor:
    """(1, 1, T, K): query i sees keys up to i + K - T (a cached history, then causal)."""
    allowed = torch.ones(queries, keys, dtype=torch.bool).tril(keys - queries)
    return torch.zeros(queries, keys, dtype=dtype).masked_fill(~allowed, hidden)[None, None]


def test_float32_is_torchs_fused_kernel() -> None:
    q, k, v = _qkv(torch.float32, 30, 50)
    bias = _causal_bias(30, 50, torch.float32)
    for b, scale in ((None, None), (bias, 0.3)):
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=b, scale=scale)
        assert torch.equal(flow_attention(q, k, v, b, scale), expected)


def test_bfloat16_with_amx_is_torchs_fused_kernel() -> None:
    q, k, v = _qkv(torch.bfloat16, 30, 50)
    bias = _causal_bias(30, 50, torch.bfloat16)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    assert torch.equal(flow_attention(q, k, v, bias, fused_bf16=True), expected)


@pytest.mark.parametrize("masked", [False, True])
def test_bfloat16_matches_exact_attention_within_rounding(masked: bool) -> None:
    q, k, v = _qkv(torch.bfloat16, 30, 50)
    bias = _causal_bias(30, 50, torch.bfloat16) if masked else None
    scale = 16**-0.5
    out = flow_attention(q, k, v, bias)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    error = (out.double() - _exact(q, k, v, bias, scale)).abs()
    # bfloat16 keeps 8 significant bits (relative rounding 2^-9 = 0.002); the outputs are
    # weighted means of unit-variance values.
    assert error.max().item() < 0.03
    assert error.mean().item() < 0.004
    fused = F.scaled_dot_product_attention(q, k, v, attn_mask=bias).double()
    fused_error = (fused - _exact(q, k, v, bias, scale)).abs().mean().item()
    assert error.mean().item() < 4 * fused_error


def test_hidden_keys_get_no_weight() -> None:
    q, k, v = _qkv(torch.bfloat16, 8, 8)
    for hidden in (-1e10, float("-inf")):
        bias = _causal_bias(8, 8, torch.bfloat16, hidden)
        out = flow_attention(q, k, v, bias)
        # The first query sees only the first key: its output is that key's value.
        assert torch.equal(out[:, :, 0], v[:, :, 0])
        assert bool(torch.isfinite(out).all())


def test_long_inputs_run_in_query_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v = _qkv(torch.bfloat16, 37, 45, seed=1)
    bias = _causal_bias(37, 45, torch.bfloat16)
    whole = flow_attention(q, k, v, bias, 0.2)
    calls = []
    original = attention._attend

    def counting(*args: Tensor | None) -> Tensor:
        calls.append(args[0].shape[-2])  # type: ignore[union-attr]
        return original(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(attention, "_attend", counting)
    monkeypatch.setattr(attention, "MAX_SCORES", 2 * 4 * 45 * 10)  # 10 query rows at a time
    blocked = flow_attention(q, k, v, bias, 0.2)
    assert calls == [10, 10, 10, 7]
    torch.testing.assert_close(blocked, whole, rtol=0, atol=2**-6)


def test_bfloat16_flow_error_is_no_worse_than_with_the_fused_kernel(flow: Flow) -> None:
    """The tiny flow in bfloat16 against float32: the split kernel's mel error stays at the
    fused kernel's (the rounding of every activation dominates)."""
    gen = torch.Generator().manual_seed(3)
    vocab = flow.cfg.vocab_size
    token = torch.randint(0, vocab, (1, 30), generator=gen)
    prompt = torch.randint(0, vocab, (1, 10), generator=gen)
    prompt_feat = torch.randn(1, 20, 80, generator=gen) - 6.0
    embedding = torch.randn(1, flow.cfg.spk_embed_dim, generator=gen)

    def mel(model: Flow) -> Tensor:
        return model.inference(token, prompt, prompt_feat, embedding, streaming=False, finalize=True).double()

    reference = mel(flow)
    low = Flow(flow.cfg)
    low.load_state_dict(flow.state_dict())
    low = low.to(torch.bfloat16).eval()
    split = (mel(low) - reference).abs().mean().item()

    low.use_fused_bf16_attention_(True)
    with_fused = (mel(low) - reference).abs().mean().item()
    assert 0 < split < 1.25 * with_fused


@pytest.mark.parametrize("rows", [50, 64])
def test_whole_key_rows_pads_rows_with_hidden_zeros(rows: int) -> None:
    x = torch.randn(2, rows, 24).to(torch.bfloat16)
    padded = -(-rows // attention.KEY_MULTIPLE) * attention.KEY_MULTIPLE
    px, bias = attention.whole_key_rows(x)
    assert px.shape == (2, padded, 24)
    assert torch.equal(px[:, :rows], x) and not px[:, rows:].any()
    assert bias.dtype == torch.bfloat16 and bias.shape == (1, 1, 1, padded)
    assert not bias[..., :rows].any() and torch.isneginf(bias[..., rows:]).all()


def test_only_bfloat16_calls_without_a_bias_on_the_fused_kernel_pad() -> None:
    x = torch.randn(2, 30, 24)
    bias = _causal_bias(30, 30, torch.bfloat16)
    assert attention.pads_keys(x.to(torch.bfloat16), None, fused_bf16=True)
    assert not attention.pads_keys(x.to(torch.bfloat16), bias, fused_bf16=True)
    assert not attention.pads_keys(x, None, fused_bf16=True)
    assert not attention.pads_keys(x.to(torch.bfloat16), None, fused_bf16=False)


def _self_attention(seed: int = 0, fused_bf16: bool = True) -> blocks.SelfAttention:
    torch.manual_seed(seed)
    layer = blocks.SelfAttention(24, heads=4, head_dim=16)
    layer.fuse_projections_()
    layer.fused_bf16 = fused_bf16
    return layer.to(torch.bfloat16).eval().requires_grad_(False)


def test_calls_with_a_bias_are_not_padded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blocks, "whole_key_rows", None)  # would fail if called
    layer = _self_attention()
    x = torch.randn(2, 30, 24).to(torch.bfloat16)
    bias = _causal_bias(30, 30, torch.bfloat16)
    with torch.inference_mode():
        assert layer(x, bias).shape == (2, 30, 24)


def test_padded_keys_give_the_unpadded_attention_within_rounding(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = _self_attention(seed=1)
    x = torch.randn(2, 45, 24).to(torch.bfloat16)  # 45 keys run as 48 on the path that pads
    with torch.inference_mode():
        padded = layer(x, None)
        monkeypatch.setattr(blocks, "pads_keys", lambda x, bias, fused: False)
        unpadded = layer(x, None)
        exact = _float64_self_attention(layer, x)
    assert padded.shape == unpadded.shape == (2, 45, 24)
    assert (padded.double() - exact).abs().max() <= 2 * (unpadded.double() - exact).abs().max() + 1e-6


def _float64_self_attention(layer: blocks.SelfAttention, x: Tensor) -> Tensor:
    """The layer's output computed in float64 from its (bfloat16) weights and input."""
    assert layer.qkv is not None
    q, k, v = (x.double() @ layer.qkv.weight.double().T).chunk(3, dim=-1)
    q, k, v = (p.view(2, -1, 4, 16).transpose(1, 2) for p in (q, k, v))
    out = _exact(q, k, v, None, 16**-0.5).transpose(1, 2).reshape(2, -1, 64)
    return out @ layer.out.weight.double().T + layer.out.bias.double()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_trace_pads_every_length_it_replays() -> None:
    """The padding's sizes are traced, not constants: a trace recorded over 50 rows pads 37
    and 64 rows as the eager call does."""
    layer = _self_attention(seed=2)

    def attend(x: Tensor) -> Tensor:
        return layer(x, None)

    def rows(count: int) -> Tensor:
        return torch.randn(2, count, 24, generator=torch.Generator().manual_seed(count)).to(torch.bfloat16)

    with torch.no_grad():  # a trace cannot record inference-mode tensors
        traced = torch.jit.trace(attend, (rows(50),), check_trace=False)
        padding = torch.jit.trace(attention.whole_key_rows, (rows(50),), check_trace=False)
        for count, padded in ((37, 48), (64, 64)):
            assert torch.equal(traced(rows(count)), attend(rows(count)))
            x, bias = padding(rows(count))
            assert x.shape == (2, padded, 24) and bias.shape == (1, 1, 1, padded)
            assert torch.isneginf(bias[..., count:]).all() and not bias[..., :count].any()
