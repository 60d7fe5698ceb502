"""Unit tests of the native flow: masks, relative positions, fixed noise, streaming
causality, batching, input validation and the flow.pt checkpoint table."""

import dataclasses
from pathlib import Path

import pytest
import torch

from cosyserve.errors import CheckpointError, InvalidRequestError, ModelDirError
from cosyserve.modeldir.presets import TINY
from cosyserve.models.flow import Flow, flow_checkpoint_table
from cosyserve.models.flow.cfm import MAX_FRAMES, fixed_noise
from cosyserve.models.flow.conformer import rel_position_embedding, rel_shift
from cosyserve.models.flow.encoder import UpsampleConformerEncoder
from cosyserve.models.flow.estimator import Estimator
from cosyserve.models.flow.masks import attention_mask, chunk_mask, padding_mask
from cosyserve.weights.checkpoint import load_checkpoint, to_checkpoint
from cosyserve.weights.randomize import randomize_


@pytest.fixture(scope="module")
def flow() -> Flow:
    model = Flow(TINY.flow)
    randomize_(model, torch.Generator().manual_seed(0))
    return model.eval()


def test_chunk_mask_is_block_causal_from_position_zero() -> None:
    expected = torch.tensor(
        [
            [1, 1, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [1, 1, 1, 1, 0],
            [1, 1, 1, 1, 0],
            [1, 1, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(chunk_mask(5, 2), expected)


def test_attention_mask_hides_padded_keys_and_future_chunks() -> None:
    valid = padding_mask(torch.tensor([4, 2]), 4)  # (2, 4)
    assert valid.tolist() == [[True] * 4, [True, True, False, False]]
    full = attention_mask(valid, 0)
    assert full.shape == (2, 4, 4)
    assert torch.equal(full[1], torch.tensor([[True, True, False, False]] * 4))
    streaming = attention_mask(valid, 3)
    assert streaming[0].tolist() == [[True, True, True, False]] * 3 + [[True] * 4]
    assert torch.equal(streaming[1], full[1])  # chunk 0 covers both valid keys


def test_rel_shift_aligns_scores_to_relative_positions() -> None:
    size = 5
    scores = torch.randn(2, 3, size, 2 * size - 1)
    got = rel_shift(scores)
    # Column m of the input encodes the distance (query - key) = size - 1 - m.
    i = torch.arange(size).unsqueeze(1)
    j = torch.arange(size).unsqueeze(0)
    index = (size - 1 - i + j).expand(2, 3, size, size)
    assert torch.equal(got, scores.gather(-1, index))


def test_rel_position_embedding_runs_from_plus_to_minus_t() -> None:
    table = rel_position_embedding(4, 6, torch.device("cpu"), torch.float32)
    assert table.shape == (1, 7, 6)
    center = table[0, 3]  # distance 0
    assert torch.equal(center, torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0, 1.0]))
    # Distance +d and -d share cosines and have opposite sines.
    assert torch.allclose(table[0, 0, 0::2], -table[0, 6, 0::2])
    assert torch.allclose(table[0, 0, 1::2], table[0, 6, 1::2])
    assert table[0, 2, 0] == pytest.approx(torch.tensor(1.0).sin().item())


def test_fixed_noise_is_upstreams_seeded_randn_without_touching_the_global_rng() -> None:
    with torch.random.fork_rng():
        torch.manual_seed(123)
        state = torch.random.get_rng_state()
        noise = fixed_noise(80)
        assert torch.equal(torch.random.get_rng_state(), state)
        torch.manual_seed(0)
        expected = torch.randn(1, 80, MAX_FRAMES)
    assert torch.equal(noise, expected)


def test_flow_holds_the_noise_but_not_in_its_state_dict(flow: Flow) -> None:
    assert torch.equal(flow.cfm.noise, fixed_noise(80))
    table = flow_checkpoint_table(TINY.flow)
    assert set(flow.state_dict()) == {m for _, m in table.entries}


def _checkpoint_with(flow: Flow, tmp_path: Path, key: str, value: torch.Tensor | None) -> Path:
    state = to_checkpoint(flow, flow_checkpoint_table(TINY.flow))
    if value is None:
        del state[key]
    else:
        state[key] = value
    path = tmp_path / "flow.pt"
    torch.save(state, path)
    return path


def test_misshaped_tensor_names_file_key_and_both_shapes(flow: Flow, tmp_path: Path) -> None:
    key = "encoder.encoders.0.self_attn.pos_bias_u"
    path = _checkpoint_with(flow, tmp_path, key, torch.zeros(3, 7))
    with torch.device("meta"):
        target = Flow(TINY.flow)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(target, path, flow_checkpoint_table(TINY.flow))
    message = str(info.value)
    assert str(path) in message and key in message
    assert "(3, 7)" in message and "(4, 128)" in message


def test_missing_tensor_is_a_checkpoint_error(flow: Flow, tmp_path: Path) -> None:
    path = _checkpoint_with(flow, tmp_path, "decoder.estimator.final_proj.bias", None)
    with torch.device("meta"):
        target = Flow(TINY.flow)
    with pytest.raises(CheckpointError, match="missing 1 tensor"):
        load_checkpoint(target, path, flow_checkpoint_table(TINY.flow))


def test_streaming_estimator_output_ignores_future_chunks() -> None:
    estimator = Estimator(TINY.flow.estimator)
    randomize_(estimator, torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(2)
    frames, chunk = 70, TINY.flow.estimator.static_chunk_size
    x, mu, cond = (torch.randn(1, 80, frames, generator=gen) for _ in range(3))
    spks, t, mask = torch.randn(1, 80, generator=gen), torch.tensor([0.3]), torch.ones(1, 1, frames)
    changed = [v.clone() for v in (x, mu, cond)]
    for v in changed:
        v[:, :, chunk:] += 1.0
    with torch.no_grad():
        for streaming in (True, False):
            bias = estimator.attention_bias(mask, streaming)
            before = estimator(x, mask, mu, t, spks, cond, bias)[:, :, :chunk]
            after = estimator(changed[0], mask, changed[1], t, spks, changed[2], bias)[:, :, :chunk]
            assert torch.allclose(before, after, atol=1e-6) == streaming


def test_streaming_encoder_first_chunk_sees_only_its_lookahead() -> None:
    cfg = TINY.flow
    encoder = UpsampleConformerEncoder(cfg.encoder, cfg.pre_lookahead_len)
    randomize_(encoder, torch.Generator().manual_seed(3))
    chunk, size = cfg.encoder.static_chunk_size, 34
    x = torch.randn(1, size, cfg.input_size, generator=torch.Generator().manual_seed(4))
    changed = x.clone()
    changed[:, chunk + cfg.pre_lookahead_len :] += 1.0
    lengths = torch.tensor([size])
    with torch.no_grad():
        before, out_lengths = encoder(x, lengths, streaming=True)
        after, _ = encoder(changed, lengths, streaming=True)
        touched, _ = encoder(
            x + 0.1 * (torch.arange(size) == chunk + 2).view(1, -1, 1), lengths, streaming=True
        )
    frames = 2 * chunk
    assert before.shape == (1, 2 * size, cfg.encoder.output_size) and out_lengths.tolist() == [2 * size]
    assert torch.allclose(before[:, :frames], after[:, :frames], atol=1e-5)
    assert not torch.allclose(before[:, :frames], touched[:, :frames], atol=1e-5)  # the look-ahead token


@pytest.mark.parametrize("streaming", [False, True])
def test_ragged_encoder_batch_rows_equal_single_rows(streaming: bool) -> None:
    cfg = TINY.flow
    encoder = UpsampleConformerEncoder(cfg.encoder, cfg.pre_lookahead_len)
    randomize_(encoder, torch.Generator().manual_seed(6))
    x = torch.randn(2, 30, cfg.input_size, generator=torch.Generator().manual_seed(7))
    # Row 1 is 20 long; its 10 padding positions hold random values that must not matter.
    with torch.no_grad():
        both, lengths = encoder(x, torch.tensor([30, 20]), streaming=streaming)
        short, _ = encoder(x[1:, :20], torch.tensor([20]), streaming=streaming)
    assert lengths.tolist() == [60, 40]
    assert torch.allclose(both[1:, :40], short, atol=1e-5)


def test_batch_rows_equal_single_requests(flow: Flow) -> None:
    gen = torch.Generator().manual_seed(5)
    token = torch.randint(0, TINY.flow.vocab_size, (2, 30), generator=gen)
    prompt_token = torch.randint(0, TINY.flow.vocab_size, (2, 4), generator=gen)
    prompt_feat = torch.randn(2, 8, 80, generator=gen)
    embedding = torch.randn(2, 192, generator=gen)
    both = flow.inference(token, prompt_token, prompt_feat, embedding, streaming=True, finalize=False)
    assert both.shape == (2, 80, 2 * (4 + 30 - 3) - 8)
    for row in range(2):
        alone = flow.inference(
            token[row : row + 1],
            prompt_token[row : row + 1],
            prompt_feat[row : row + 1],
            embedding[row : row + 1],
            streaming=True,
            finalize=False,
        )
        assert torch.allclose(both[row : row + 1], alone, atol=1e-5)


def _inputs(tokens: int = 6, prompt: int = 2) -> dict[str, torch.Tensor]:
    return {
        "token": torch.zeros(1, tokens, dtype=torch.long),
        "prompt_token": torch.zeros(1, prompt, dtype=torch.long),
        "prompt_feat": torch.zeros(1, 2 * prompt, 80),
        "embedding": torch.ones(1, 192),
    }


@pytest.mark.parametrize(
    ("change", "finalize", "message"),
    [
        ({"token": torch.zeros(6, dtype=torch.long)}, True, "shapes"),
        ({"prompt_token": torch.zeros(2, 2, dtype=torch.long)}, True, "shapes"),
        ({"prompt_feat": torch.zeros(1, 4, 40)}, True, "shapes"),
        ({"embedding": torch.ones(1, 80)}, True, "shapes"),
        ({"token": torch.zeros(1, 6)}, True, "integers"),
        (
            {
                "token": torch.zeros(1, 1, dtype=torch.long),
                "prompt_token": torch.zeros(1, 2, dtype=torch.long),
            },
            False,
            "at least 4 tokens",
        ),
        ({"prompt_feat": torch.zeros(1, 17, 80)}, True, "17 frames"),
        ({"token": torch.full((1, 6), 6561)}, True, "outside the vocabulary"),
    ],
)
def test_invalid_inputs_raise_invalid_request(
    flow: Flow, change: dict[str, torch.Tensor], finalize: bool, message: str
) -> None:
    args = _inputs() | change
    with pytest.raises(InvalidRequestError, match=message):
        flow.inference(**args, streaming=False, finalize=finalize)


def test_unsupported_geometry_is_a_model_dir_error() -> None:
    estimator = dataclasses.replace(TINY.flow.estimator, channels=(32, 32))
    with pytest.raises(ModelDirError, match="one level"):
        Flow(dataclasses.replace(TINY.flow, estimator=estimator))
