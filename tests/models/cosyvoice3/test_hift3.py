"""The CosyVoice 3 vocoder without upstream: checkpoint loading, the stream's bookkeeping,
the noise table (parity with upstream is test_hift_parity.py)."""

from functools import cache
from pathlib import Path

import pytest
import torch

from cosyserve.modeldir.presets import TINY3
from cosyserve.models.hift3 import (
    CausalHiFTGenerator,
    CausalHiFTStream,
    causal_hift_checkpoint_table,
    noise_window,
)
from cosyserve.models.hift3.source import NOISE_BLOCK
from cosyserve.weights.checkpoint import load_checkpoint, to_checkpoint
from cosyserve.weights.randomize import randomize_

CFG = TINY3.hift


@cache
def hift() -> CausalHiFTGenerator:
    model = CausalHiFTGenerator(CFG).eval()
    randomize_(model, torch.Generator().manual_seed(0))
    return model


def mel(frames: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(1, CFG.in_channels, frames, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("old_form", [False, True])
def test_checkpoint_round_trip_keeps_the_f0_weight_norm_pairs(tmp_path: Path, old_form: bool) -> None:
    """Through a file under ``generator.``, in either weight-norm storage form: the f0
    predictor gets (g, v) as stored, the other convolutions folded weights."""
    table = causal_hift_checkpoint_table(CFG)
    state = to_checkpoint(hift(), table)
    assert "f0_predictor.condnet.0.parametrizations.weight.original0" in state
    if old_form:
        renamed = {}
        for key, value in state.items():
            key = key.replace(".parametrizations.weight.original0", ".weight_g")
            renamed[key.replace(".parametrizations.weight.original1", ".weight_v")] = value
        state = renamed
    path = tmp_path / "hift.pt"
    torch.save({f"generator.{k}": v for k, v in state.items()}, path)
    loaded = CausalHiFTGenerator(CFG).eval()
    load_checkpoint(loaded, path, table)
    for key, value in hift().state_dict().items():
        assert torch.allclose(loaded.state_dict()[key], value, rtol=1e-6, atol=1e-7), key
    wave, _ = loaded.inference(mel(12), True)
    expected, _ = hift().inference(mel(12), True)
    assert float((wave - expected).abs().max()) < 1e-5


def test_stream_returns_upstreams_sample_counts() -> None:
    """(M - 8) * 480 samples in all after a non-final push of M frames in all, M * 480 after the final."""
    stream = CausalHiFTStream(hift())
    total, emitted = 0, 0
    for frames in (5, 4, 20, 1, 0, 30):
        total += frames
        emitted += stream.push(mel(frames, seed=total), finalize=False).shape[1]
        assert emitted == max(0, total - 8) * CFG.upsample_factor
    emitted += stream.push(mel(3), finalize=True).shape[1]
    assert emitted == (total + 3) * CFG.upsample_factor
    assert stream.finished


@pytest.mark.parametrize("frames", [1, 2, 5, 9])
def test_short_streams_match_one_call(frames: int) -> None:
    whole, _ = hift().inference(mel(frames), True)
    stream = CausalHiFTStream(hift())
    pieces = [stream.push(mel(frames)[:, :, :0], finalize=False)]
    pieces += [stream.push(mel(frames)[:, :, i : i + 1], finalize=i == frames - 1) for i in range(frames)]
    assert torch.allclose(torch.cat(pieces, dim=1), whole, atol=1e-5)


def test_stream_misuse_is_refused() -> None:
    stream = CausalHiFTStream(hift())
    with pytest.raises(ValueError, match="batch"):
        stream.push(torch.zeros(2, CFG.in_channels, 4), finalize=False)
    stream.push(mel(4), finalize=True)
    with pytest.raises(ValueError, match="finalised"):
        stream.push(mel(4), finalize=True)


def test_batch_rows_vocode_independently() -> None:
    batch = torch.cat([mel(20, seed=1), mel(20, seed=2)])
    both, _ = hift().inference(batch, True)
    second, _ = hift().inference(batch[1:], True)
    assert torch.allclose(both[1:], second, atol=1e-5)


def test_noise_window_is_one_table_across_blocks() -> None:
    start, stop = NOISE_BLOCK - 7, NOISE_BLOCK + 5
    whole = noise_window(3, 9, 0, 2 * NOISE_BLOCK)
    assert torch.equal(noise_window(3, 9, start, stop), whole[start:stop])
    assert not torch.equal(noise_window(4, 9, 0, 10), whole[:10])
    assert float(whole.min()) >= 0.0 and float(whole.max()) < 1.0
