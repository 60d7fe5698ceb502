"""HiFT vocoder behaviour without the upstream reference: shapes, determinism, batching,
checkpoint loading and the streaming state."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from cosyserve.errors import CheckpointError
from cosyserve.modeldir.presets import TINY
from cosyserve.models.hift import (
    Excitation,
    HiFTGenerator,
    HiFTStreamState,
    StreamOptions,
    hift_checkpoint_table,
    vocode_chunk,
)
from cosyserve.models.hift.resblock import Snake
from cosyserve.weights.checkpoint import load_checkpoint, to_checkpoint
from cosyserve.weights.randomize import randomize_

CFG = TINY.hift
SINES = CFG.nb_harmonics + 1
FRAMES = 12


@pytest.fixture(scope="module")
def hift() -> HiFTGenerator:
    module = HiFTGenerator(CFG).eval()
    randomize_(module, torch.Generator().manual_seed(0))
    return module


def _mel(batch: int = 1, frames: int = FRAMES, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, CFG.in_channels, frames, generator=torch.Generator().manual_seed(seed))


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_inference_shapes_and_limit(hift: HiFTGenerator) -> None:
    wave, source = hift.inference(_mel(batch=2), generator=_seeded(0))
    samples = FRAMES * CFG.upsample_factor
    assert wave.shape == (2, samples)
    assert source.shape == (2, 1, samples)
    assert wave.abs().max() <= CFG.audio_limit
    assert wave.std() > 0


def test_same_seed_same_wave_and_explicit_excitation_equals_drawn(hift: HiFTGenerator) -> None:
    mel = _mel()
    first, _ = hift.inference(mel, generator=_seeded(5))
    again, _ = hift.inference(mel, generator=_seeded(5))
    drawn = Excitation.draw(1, SINES, FRAMES * CFG.upsample_factor, _seeded(5))
    injected, _ = hift.inference(mel, excitation=drawn)
    other, _ = hift.inference(mel, generator=_seeded(6))
    assert torch.equal(first, again)
    assert torch.equal(first, injected)
    assert not torch.equal(first, other)


def test_global_rng_is_untouched(hift: HiFTGenerator) -> None:
    torch.manual_seed(11)
    expected = torch.rand(4)
    torch.manual_seed(11)
    hift.inference(_mel(), generator=_seeded(0))
    assert torch.equal(torch.rand(4), expected)


def test_batch_rows_with_own_generators_equal_single_requests(hift: HiFTGenerator) -> None:
    mels = _mel(batch=2)
    batched, _ = hift.inference(mels, generator=[_seeded(1), _seeded(2)])
    for row, seed in enumerate((1, 2)):
        single, _ = hift.inference(mels[row : row + 1], generator=_seeded(seed))
        torch.testing.assert_close(batched[row : row + 1], single, rtol=0, atol=1e-5)


def test_cache_source_replaces_the_start_of_the_source(hift: HiFTGenerator) -> None:
    cache = torch.full((1, 1, 1000), 0.25)
    _, source = hift.inference(_mel(), cache, generator=_seeded(0))
    _, fresh = hift.inference(_mel(), generator=_seeded(0))
    assert torch.equal(source[:, :, :1000], cache)
    assert torch.equal(source[:, :, 1000:], fresh[:, :, 1000:])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "a generator or an excitation"),
        ({"generator": _seeded(0), "excitation": Excitation(torch.zeros(1, SINES, 10))}, "not both"),
        ({"excitation": Excitation(torch.zeros(1, SINES, 10))}, "excitation noise has shape"),
        ({"generator": [_seeded(0), _seeded(1)]}, "2 generators for a batch of 1"),
        ({"generator": _seeded(0), "cache_source": torch.zeros(1, 1, FRAMES * 480 + 1)}, "does not fit"),
    ],
)
def test_invalid_inference_arguments(hift: HiFTGenerator, kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        hift.inference(_mel(), **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "change",
    [
        {"sampling_rate": 22050},
        {"f0_num_class": 2},
        {"base_channels": 36},
        {"upsample_kernel_sizes": (16, 11)},
        {"resblock_kernel_sizes": (3, 8, 11)},
    ],
)
def test_unsupported_configs_are_rejected(change: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        HiFTGenerator(replace(CFG, **change))  # type: ignore[arg-type]


def test_module_state_is_exactly_the_table() -> None:
    table = hift_checkpoint_table(CFG)
    state = HiFTGenerator(CFG).state_dict()
    assert set(state) == {ours for _, ours in table.entries}
    assert "window" not in state


def _save(state: dict[str, torch.Tensor], path: Path) -> Path:
    torch.save(state, path)
    return path


def _to_weight_g_v(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    renamed = {}
    for key, value in state.items():
        key = key.replace(".parametrizations.weight.original0", ".weight_g")
        renamed[key.replace(".parametrizations.weight.original1", ".weight_v")] = value
    return renamed


def test_both_weight_norm_forms_and_the_prefix_load_identical_weights(
    hift: HiFTGenerator, tmp_path: Path
) -> None:
    table = hift_checkpoint_table(CFG)
    official = to_checkpoint(hift, table)
    assert any(k.endswith(".parametrizations.weight.original1") for k in official)
    files = [
        _save(official, tmp_path / "parametrizations.pt"),
        _save(_to_weight_g_v(official), tmp_path / "weight_g_v.pt"),
        _save({f"generator.{k}": v for k, v in official.items()}, tmp_path / "prefixed.pt"),
    ]
    loaded = []
    for path in files:
        module = HiFTGenerator(CFG)
        load_checkpoint(module, path, table)
        loaded.append(module.state_dict())
    for state in loaded[1:]:
        assert all(torch.equal(state[k], loaded[0][k]) for k in state)
    for key, value in hift.state_dict().items():
        torch.testing.assert_close(loaded[0][key], value, rtol=1e-6, atol=1e-6)


def test_mis_shaped_tensor_names_file_key_and_shapes(hift: HiFTGenerator, tmp_path: Path) -> None:
    table = hift_checkpoint_table(CFG)
    official = to_checkpoint(hift, table)
    official["source_downs.1.weight"] = torch.zeros(3, 3, 3)
    path = _save(official, tmp_path / "hift.pt")
    expected = tuple(hift.state_dict()["stages.1.source_down.weight"].shape)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(HiFTGenerator(CFG), path, table)
    message = str(info.value)
    assert str(path) in message
    assert "'source_downs.1.weight'" in message
    assert "(3, 3, 3)" in message
    assert str(expected) in message


def test_stream_emits_every_sample_once(hift: HiFTGenerator) -> None:
    mel = _mel(frames=30)
    state = HiFTStreamState()
    cuts = [(0, 10, False), (10, 20, False), (20, 30, True)]
    emitted = [
        vocode_chunk(hift, state, mel[:, :, a:b], finalize=last, generator=_seeded(a)) for a, b, last in cuts
    ]
    overlap = StreamOptions().overlap
    assert [e.shape[1] for e in emitted] == [10 * 480 - overlap, 10 * 480, 10 * 480 + overlap]
    assert state.finished
    with pytest.raises(ValueError, match="finalised"):
        state.prepare(mel)


def test_stream_rejects_a_short_first_chunk_and_a_mismatched_vocoder(hift: HiFTGenerator) -> None:
    with pytest.raises(ValueError, match="at least 8 mel frames"):
        vocode_chunk(hift, HiFTStreamState(), _mel(frames=5), finalize=False, generator=_seeded(0))
    state = HiFTStreamState(StreamOptions(samples_per_frame=256))
    with pytest.raises(ValueError, match="256 samples per frame"):
        vocode_chunk(hift, state, _mel(), finalize=False, generator=_seeded(0))


def test_snake_writes_only_its_own_output_and_gives_the_formulas_bits() -> None:
    snake = Snake(64)
    with torch.no_grad():
        snake.alpha.copy_(torch.rand(64) * 2)
        snake.alpha[0] = 0.0  # the epsilon keeps 1/alpha finite
    x = torch.randn(2, 64, 500)
    before = x.clone()
    alpha = snake.alpha.detach()[:, None]
    want = x + (alpha + 1e-9).reciprocal() * torch.sin(x * alpha).pow(2)
    with torch.inference_mode():
        got = snake(x)
    assert torch.equal(got, want) and torch.equal(x, before)
