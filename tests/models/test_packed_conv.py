"""float32 convolutions packed for oneDNN: nn.Conv1d's outputs to float32 rounding, swapped
in for HiFT's convolutions at load on CPU, and nothing swapped where the ops are missing."""

from pathlib import Path

import pytest
import torch
from torch import nn

from cosyserve.loader import load_model
from cosyserve.models import packed_conv
from cosyserve.models.packed_conv import PackedConv1d, conv_packing_available, pack_conv1ds_

needs_packing = pytest.mark.skipif(not conv_packing_available(), reason="no oneDNN packed convolutions here")


@needs_packing
@pytest.mark.parametrize(
    ("options", "length"),
    [
        ({"kernel_size": 3, "padding": 1}, 7),  # the f0 predictor's, on a stream chunk's frames
        ({"kernel_size": 11, "dilation": 5, "padding": 25}, 3000),  # a resblock's dilated conv
        ({"kernel_size": 7, "padding": 3, "bias": False}, 130),
        ({"kernel_size": 1}, 50),  # the source's 1x1 projection
        ({"kernel_size": 10, "stride": 5, "padding": 2}, 401),  # the source's strided downsampling
    ],
)
def test_packed_conv_gives_conv1d_to_float32_rounding(options: dict[str, int], length: int) -> None:
    gen = torch.Generator().manual_seed(0)
    conv = nn.Conv1d(24, 16, **options)  # type: ignore[arg-type]  # the options are Conv1d's own
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=gen))
    packed = PackedConv1d(conv)
    for batch in (1, 2):
        x = torch.randn(batch, 24, length, generator=gen)
        with torch.inference_mode():
            got, want = packed(x), conv(x)
            exact = conv.double()(x.double())
            conv.float()
        assert got.shape == want.shape and got.dtype == torch.float32
        # Another order of the same float32 sums: of the size of torch's own error against
        # float64 (its largest error came to at most 2.5x torch's in 100 seeded cases).
        assert (got - exact).abs().max() <= 4 * (want - exact).abs().max() + 1e-6


def test_packed_conv_refuses_what_it_cannot_run() -> None:
    with pytest.raises(ValueError, match=r"float32 CPU Conv1d with zero padding, not torch\.bfloat16"):
        PackedConv1d(nn.Conv1d(4, 4, 3).to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"with 'reflect' padding"):
        PackedConv1d(nn.Conv1d(4, 4, 3, padding=1, padding_mode="reflect"))
    with pytest.raises(ValueError, match=r"numeric padding, not 'same'"):
        PackedConv1d(nn.Conv1d(4, 4, 3, padding="same"))


@needs_packing
def test_pack_conv1ds_swaps_only_float32_conv1ds() -> None:
    inner = nn.Sequential(nn.Conv1d(4, 4, 3), nn.ConvTranspose1d(4, 4, 4, 2), nn.Conv1d(4, 4, 1).bfloat16())
    outer = nn.ModuleDict({"inner": inner, "conv": nn.Conv1d(4, 8, 3, padding=1)})
    assert pack_conv1ds_(outer) == 2
    assert isinstance(inner[0], PackedConv1d) and isinstance(outer["conv"], PackedConv1d)
    assert type(inner[1]) is nn.ConvTranspose1d and type(inner[2]) is nn.Conv1d


def test_pack_conv1ds_changes_nothing_without_the_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(packed_conv, "conv_packing_available", lambda: False)
    module = nn.Sequential(nn.Conv1d(4, 4, 3))
    assert pack_conv1ds_(module) == 0
    assert type(module[0]) is nn.Conv1d


def test_packing_is_unavailable_where_the_ops_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(*_: object) -> None:
        raise RuntimeError("no such op")

    monkeypatch.setattr(packed_conv, "PackedConv1d", missing)
    assert not conv_packing_available()


@needs_packing
def test_the_cpu_loader_packs_every_hift_conv1d(tiny_model_dir: Path) -> None:
    hift = load_model(tiny_model_dir).hift
    packed = [m for m in hift.modules() if isinstance(m, PackedConv1d)]
    assert packed and not [m for m in hift.modules() if type(m) is nn.Conv1d]
