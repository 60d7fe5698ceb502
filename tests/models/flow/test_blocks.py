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


@pytest.mark.parametrize("kernel", [1, 3, 4])
def test_tap_windows_hold_each_frames_window_tap_by_tap(kernel: int) -> None:
    rows = torch.arange(2 * 7 * 5, dtype=torch.float32).view(2, 7, 5)  # (B, L, C)
    windows = blocks.tap_windows(rows, kernel)
    frames = 7 - kernel + 1
    assert windows.shape == (2 * frames, kernel * 5)
    for b in range(2):
        for t in range(frames):
            assert torch.equal(windows[b * frames + t], rows[b, t : t + kernel].reshape(-1))
    # A strided view of the rows (a (B, C, L) tensor transposed) gives the same windows.
    assert torch.equal(blocks.tap_windows(rows.transpose(1, 2).contiguous().transpose(1, 2), kernel), windows)


@pytest.mark.skipif(not packing_available(), reason="this CPU has no oneDNN bfloat16 matmul")
@pytest.mark.parametrize("bias", [True, False])
def test_packed_convolutions_run_as_the_product(bias: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Packed weights give the bits of ``F.linear`` over the frames' windows with the weight
    laid out tap by tap, short inputs and long ones alike (more rows than GEMM_CONV_ROWS),
    stay close to torch's convolution, and never call it."""
    module = nn.Sequential(_conv(24, 16, 3, bias), _conv(16, 16, 1, bias)).to(torch.bfloat16)
    shapes = ((1, 3), (2, 12), (2, 40), (2, 2 * GEMM_CONV_ROWS))
    inputs = [torch.randn(batch, 24, frames, dtype=torch.bfloat16) for batch, frames in shapes]

    def by_taps(conv: nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
        kernel = conv.kernel_size[0]
        weight = conv.weight.permute(0, 2, 1).reshape(conv.out_channels, -1)
        out = torch.nn.functional.linear(blocks.tap_windows(x.transpose(1, 2), kernel), weight, conv.bias)
        return out.view(x.shape[0], -1, conv.out_channels).transpose(1, 2)

    with torch.inference_mode():
        want = [module[1](module[0](x)) for x in inputs]  # torch's convolutions
        products = [by_taps(module[1], by_taps(module[0], x)) for x in inputs]
        assert pack_convs_(module) == 2
        assert isinstance(module[0].gemm, PackedLinear)
        for conv in module:
            monkeypatch.setattr(conv, "forward", _no_convolution)
        got = [conv1d(module[1], conv1d(module[0], x)) for x in inputs]
    assert all(torch.equal(g, p) for g, p in zip(got, products, strict=True))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.float(), w.float(), rtol=0.02, atol=0.05)


@pytest.mark.skipif(not packing_available(), reason="this CPU has no oneDNN bfloat16 matmul")
def test_packed_causal_convolution_pads_rows_as_the_generic_path_pads_channels() -> None:
    """Without stream states a packed convolution's input is padded as rows; the result is
    the padded (B, C, T) input's, whichever layout the input comes in."""
    conv = _conv(24, 16, 3).to(torch.bfloat16)
    pack_convs_(conv)
    frames = torch.randn(2, 30, 24, dtype=torch.bfloat16)  # (B, T, C)
    with torch.inference_mode():
        for x in (frames.transpose(1, 2), frames.transpose(1, 2).contiguous()):
            want = conv1d(conv, torch.nn.functional.pad(x, (2, 0)).contiguous())
            assert torch.equal(causal_conv(conv, x), want)


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
