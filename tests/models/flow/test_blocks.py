"""The estimator's convolutions (short inputs as one matrix product, long ones as
convolutions, the same results either way) and its Mish."""

import pytest
import torch
from torch import nn

from cosyserve.models.flow import blocks
from cosyserve.models.flow.blocks import GEMM_CONV_ROWS, causal_conv, conv1d, mish, pack_convs_
from cosyserve.models.packed_linear import PackedLinear, packing_available


def _conv(c_in: int, c_out: int, kernel: int, bias: bool = True) -> nn.Conv1d:
    torch.manual_seed(kernel * 100 + c_in)
    return nn.Conv1d(c_in, c_out, kernel_size=kernel, bias=bias).eval()


@pytest.mark.parametrize(("c_in", "c_out", "kernel"), [(24, 16, 3), (16, 16, 1), (32, 8, 4), (40, 16, 7)])
@pytest.mark.parametrize(("batch", "frames"), [(1, 1), (2, 10), (2, GEMM_CONV_ROWS // 2), (3, 40)])
def test_conv1d_equals_the_convolution(c_in: int, c_out: int, kernel: int, batch: int, frames: int) -> None:
    conv = _conv(c_in, c_out, kernel)
    x = torch.randn(batch, c_in, frames + kernel - 1)
    with torch.inference_mode():
        expected = conv(x)
        got = conv1d(conv, x)
    assert got.shape == expected.shape == (batch, c_out, frames)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_short_inputs_skip_the_convolution_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    conv = _conv(24, 16, 3, bias=False)
    calls: list[int] = []
    forward = conv.forward

    def counted(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0] * (x.shape[2] - 2))
        return forward(x)

    monkeypatch.setattr(conv, "forward", counted)
    with torch.inference_mode():
        short = causal_conv(conv, torch.randn(2, 24, 10))  # 20 rows: a stream's chunk
        assert calls == []
        long = causal_conv(conv, torch.randn(2, 24, GEMM_CONV_ROWS))
        assert calls == [2 * GEMM_CONV_ROWS]
        monkeypatch.setattr(blocks, "GEMM_CONV_ROWS", 0)
        x = torch.randn(2, 24, 10)
        torch.testing.assert_close(causal_conv(conv, x), conv1d(conv, torch.nn.functional.pad(x, (2, 0))))
    assert short.shape == (2, 16, 10) and long.shape == (2, 16, GEMM_CONV_ROWS)


def test_bf16_short_convolution_stays_close() -> None:
    conv = _conv(24, 16, 3).to(torch.bfloat16)
    x = torch.randn(2, 24, 12, dtype=torch.bfloat16)
    with torch.inference_mode():
        expected, got = conv(x).float(), conv1d(conv, x).float()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=0.02, atol=0.05)


@pytest.mark.skipif(not packing_available(), reason="this CPU has no oneDNN bfloat16 matmul")
@pytest.mark.parametrize("bias", [True, False])
def test_packed_convolutions_run_as_the_product(bias: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Packed weights give the unpacked product's bits, short inputs and long ones alike
    (more rows than GEMM_CONV_ROWS), and never call torch's convolution."""
    module = nn.Sequential(_conv(24, 16, 3, bias), _conv(16, 16, 1, bias)).to(torch.bfloat16)
    shapes = ((1, 3), (2, 12), (2, 40), (2, 2 * GEMM_CONV_ROWS))
    inputs = [torch.randn(batch, 24, frames, dtype=torch.bfloat16) for batch, frames in shapes]
    with torch.inference_mode():
        want = [module[1](module[0](x)) for x in inputs]  # torch's convolutions
        with monkeypatch.context() as patch:
            patch.setattr(blocks, "GEMM_CONV_ROWS", 10**9)
            unpacked = [conv1d(module[1], conv1d(module[0], x)) for x in inputs]
        assert pack_convs_(module) == 2
        assert isinstance(module[0].gemm, PackedLinear)
        for conv in module:
            monkeypatch.setattr(conv, "forward", _no_convolution)
        got = [conv1d(module[1], conv1d(module[0], x)) for x in inputs]
    assert all(torch.equal(g, u) for g, u in zip(got, unpacked, strict=True))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.float(), w.float(), rtol=0.02, atol=0.05)


def _no_convolution(x: torch.Tensor) -> torch.Tensor:
    raise AssertionError("torch's convolution ran")


def _mish_inputs() -> torch.Tensor:
    torch.manual_seed(0)
    extremes = torch.tensor([-1e30, -200.0, -50.0, -20.0, -1e-3, 0.0, 1e-3, 19.9, 20.0, 20.1, 50.0, 1e30])
    return torch.cat([torch.randn(4000) * 6, extremes, torch.tensor([float("inf"), float("nan")])])


def test_mish_is_as_close_to_float64_as_torchs() -> None:
    x = _mish_inputs()
    exact = torch.nn.functional.mish(x.double())
    finite = exact.isfinite()
    ours = mish(x).double()
    torch_error = (torch.nn.functional.mish(x).double() - exact)[finite].abs().max()
    assert (ours - exact)[finite].abs().max() <= torch_error
    assert ours[-2] == float("inf") and ours[-1].isnan()


def test_bf16_mish_rounds_once() -> None:
    """bfloat16 in, bfloat16 out: within half an ulp of the float64 value."""
    x = _mish_inputs()[:-2].to(torch.bfloat16)
    got = mish(x)
    assert got.dtype == torch.bfloat16
    exact = torch.nn.functional.mish(x.double())
    torch.testing.assert_close(got.double(), exact, rtol=2**-8, atol=1e-30)
