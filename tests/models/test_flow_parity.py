"""Numerical parity of the flow against upstream ``CausalMaskedDiffWithXvec``.

One random checkpoint file (TINY geometry) feeds both sides: upstream loads it strictly, ours
through :func:`load_checkpoint` and the flow checkpoint table.
"""

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from cosyserve.modeldir.hparams import ModelHParams
from cosyserve.modeldir.presets import FULL, TINY
from cosyserve.modeldir.yamlwrite import render_yaml
from cosyserve.models.flow import Flow, flow_checkpoint_table
from cosyserve.weights.checkpoint import load_checkpoint, to_checkpoint
from cosyserve.weights.randomize import randomize_
from tests.upstream import load_yaml_sections

pytestmark = [
    pytest.mark.parity,
    # Upstream's Matcha blocks build diffusers' deprecated LoRACompatibleLinear.
    pytest.mark.filterwarnings("ignore:.*LoRACompatibleLinear:FutureWarning"),
]

TOLERANCE = 1e-4
PROMPT_TOKENS = 20
TOKENS = 60
# CosyVoice2Model constants (spec §7): hop in tokens, and flow.pre_lookahead_len.
TOKEN_HOP = 25
LOOKAHEAD = 3


@dataclass(frozen=True)
class Inputs:
    token: torch.Tensor  # (1, N) int64
    prompt_token: torch.Tensor  # (1, P) int64
    prompt_feat: torch.Tensor  # (1, 2P, 80) float32
    embedding: torch.Tensor  # (1, 192) float32


def build_upstream_flow(hp: ModelHParams) -> Any:
    # Upstream's CFM reseeds the global RNGs while it is built; keep ours untouched.
    with torch.random.fork_rng():
        return load_yaml_sections(render_yaml(hp), ("flow",))["flow"]


def load_pair(hp: ModelHParams, directory: Path, seed: int) -> tuple[Any, Flow]:
    """(upstream flow, our flow), both loaded from the same random ``flow.pt``."""
    table = flow_checkpoint_table(hp.flow)
    source = Flow(hp.flow)
    randomize_(source, torch.Generator().manual_seed(seed))
    path = directory / "flow.pt"
    torch.save(to_checkpoint(source, table), path)

    theirs = build_upstream_flow(hp)
    theirs.load_state_dict(torch.load(path, weights_only=True), strict=True)
    ours = Flow(hp.flow)
    load_checkpoint(ours, path, table)
    return theirs.eval(), ours.eval()


@pytest.fixture(scope="module")
def flows(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Flow]:
    return load_pair(TINY, Path(tmp_path_factory.mktemp("flow")), seed=1234)


@pytest.fixture(scope="module")
def inputs() -> Inputs:
    gen = torch.Generator().manual_seed(7)
    vocab = TINY.flow.vocab_size
    return Inputs(
        token=torch.randint(0, vocab, (1, TOKENS), generator=gen),
        prompt_token=torch.randint(0, vocab, (1, PROMPT_TOKENS), generator=gen),
        prompt_feat=torch.randn(1, 2 * PROMPT_TOKENS, 80, generator=gen),
        embedding=torch.randn(1, 192, generator=gen),
    )


def upstream_inference(
    flow: Any, x: Inputs, token: torch.Tensor, streaming: bool, finalize: bool
) -> torch.Tensor:
    def length(t: torch.Tensor) -> torch.Tensor:
        return torch.tensor([t.shape[1]], dtype=torch.int32)

    mel, _ = flow.inference(
        token=token,
        token_len=length(token),
        prompt_token=x.prompt_token,
        prompt_token_len=length(x.prompt_token),
        prompt_feat=x.prompt_feat,
        prompt_feat_len=length(x.prompt_feat),
        embedding=x.embedding,
        streaming=streaming,
        finalize=finalize,
    )
    return mel  # type: ignore[no-any-return]


def stream_calls(prompt_len: int, n_tokens: int) -> list[tuple[int, int, bool]]:
    """(token end, token_offset, finalize) of each ``token2wav`` call that upstream's
    ``CosyVoice2Model.tts(stream=True)`` makes once all ``n_tokens`` are generated.

    The first hop is padded so that prompt + hop ends on a 25-token chunk boundary; each
    intermediate call carries ``LOOKAHEAD`` extra tokens; the last call takes the rest.
    """
    pad = math.ceil(prompt_len / TOKEN_HOP) * TOKEN_HOP - prompt_len
    calls, offset = [], 0
    while True:
        hop = TOKEN_HOP + pad if offset == 0 else TOKEN_HOP
        if n_tokens - offset < hop + LOOKAHEAD:
            break
        calls.append((offset + hop + LOOKAHEAD, offset, False))
        offset += hop
    calls.append((n_tokens, offset, True))
    return calls


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max())


Call = tuple[int, bool, bool]  # (token end, streaming, finalize)


@pytest.fixture(scope="module")
def mels(flows: tuple[Any, Flow], inputs: Inputs) -> dict[Call, tuple[torch.Tensor, torch.Tensor]]:
    """(upstream mel, our mel) for every distinct call the tests compare, each run once.

    The last streaming call (all tokens, finalize, full attention) is the non-streaming call.
    """
    theirs, ours = flows
    calls = {(end, not finalize, finalize) for end, _, finalize in stream_calls(PROMPT_TOKENS, TOKENS)}
    out = {}
    for end, streaming, finalize in sorted(calls):
        token = inputs.token[:, :end]
        expected = upstream_inference(theirs, inputs, token, streaming, finalize)
        got = ours.inference(
            token, inputs.prompt_token, inputs.prompt_feat, inputs.embedding, streaming, finalize
        )
        out[end, streaming, finalize] = (expected, got)
    return out


def test_non_streaming_mel_matches_upstream(mels: dict[Call, tuple[torch.Tensor, torch.Tensor]]) -> None:
    expected, got = mels[TOKENS, False, True]
    assert got.dtype == torch.float32
    assert got.shape == (1, 80, 2 * TOKENS)
    assert float(expected.std()) > 0.1  # random weights still give a non-trivial mel
    diff = max_abs_diff(got, expected)
    assert diff <= TOLERANCE, f"max abs diff {diff:.3g}"


def test_stream_calls_follow_the_hop_schedule() -> None:
    # 20 prompt tokens: the first hop is 25 + 5 so that 20 + 30 ends on a chunk boundary.
    assert stream_calls(PROMPT_TOKENS, TOKENS) == [(33, 0, False), (58, 30, False), (60, 55, True)]


def test_streaming_chunks_match_upstream(mels: dict[Call, tuple[torch.Tensor, torch.Tensor]]) -> None:
    ratio = TINY.flow.token_mel_ratio
    for end, offset, finalize in stream_calls(PROMPT_TOKENS, TOKENS):
        # As upstream's token2wav: the final call runs without streaming (full attention).
        expected, got = mels[end, not finalize, finalize]
        diff = max_abs_diff(got[:, :, offset * ratio :], expected[:, :, offset * ratio :])
        assert diff <= TOLERANCE, f"chunk ending at token {end}: max abs diff {diff:.3g}"


# TINY's estimator attention is exactly as wide as its channels (2 x 16 = 32) and has one
# block per stage; the released model's is wider (8 x 64 = 512 vs 256). This geometry
# covers both, and several layers per encoder stack, at TINY cost.
WIDE_ATTENTION = dataclasses.replace(
    TINY,
    flow=dataclasses.replace(
        TINY.flow,
        encoder=dataclasses.replace(TINY.flow.encoder, num_blocks=2, attention_heads=8),
        estimator=dataclasses.replace(TINY.flow.estimator, attention_head_dim=24, n_blocks=2),
    ),
)


def test_wide_attention_geometry_streaming_matches_upstream(tmp_path: Path, inputs: Inputs) -> None:
    theirs, ours = load_pair(WIDE_ATTENTION, tmp_path, seed=99)
    token = inputs.token[:, :36]  # prompt 20 + 36 - 3 look-ahead = 53 tokens: three chunks
    expected = upstream_inference(theirs, inputs, token, streaming=True, finalize=False)
    got = ours.inference(
        token, inputs.prompt_token, inputs.prompt_feat, inputs.embedding, streaming=True, finalize=False
    )
    diff = max_abs_diff(got, expected)
    assert diff <= TOLERANCE, f"max abs diff {diff:.3g}"


def assert_table_matches_upstream(hp: ModelHParams) -> None:
    """The table covers exactly upstream's state-dict keys, and maps each to one of our
    tensors of the same shape (built on the meta device: shapes only, no memory)."""
    with torch.device("meta"):
        theirs = build_upstream_flow(hp).state_dict()
        ours = Flow(hp.flow).state_dict()
    table = flow_checkpoint_table(hp.flow)
    assert {c for c, _ in table.entries} == set(theirs)
    assert {m for _, m in table.entries} == set(ours)
    for ckpt_key, module_key in table.entries:
        assert theirs[ckpt_key].shape == ours[module_key].shape, ckpt_key


def test_table_keys_equal_upstream_state_dict_tiny() -> None:
    assert_table_matches_upstream(TINY)


def test_table_keys_equal_upstream_state_dict_full() -> None:
    # Built on the meta device this takes well under a second, so it runs by default.
    assert_table_matches_upstream(FULL)


@pytest.mark.slow
def test_full_geometry_streaming_matches_upstream(tmp_path: Path, inputs: Inputs) -> None:
    """The released geometry (about 100M parameters; minutes on CPU)."""
    theirs, ours = load_pair(FULL, tmp_path, seed=5)
    token = inputs.token[:, :33]  # the first streaming call of the schedule above
    expected = upstream_inference(theirs, inputs, token, streaming=True, finalize=False)
    got = ours.inference(
        token, inputs.prompt_token, inputs.prompt_feat, inputs.embedding, streaming=True, finalize=False
    )
    diff = max_abs_diff(got, expected)
    assert diff <= TOLERANCE, f"max abs diff {diff:.3g}"
