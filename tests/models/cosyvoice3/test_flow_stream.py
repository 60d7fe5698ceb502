"""Incremental streaming (:class:`Flow3Stream`) against upstream's streaming calls (the
committed flow fixtures) and against our own whole-prefix inference."""

import pytest
import torch

from cosyserve.models.dit import Flow3Stream
from tests.models.cosyvoice3.make_flow_fixtures import FULL_CASE, LOOKAHEAD, TINY_CASE, Geometry, stream_calls
from tests.models.cosyvoice3.test_flow_parity import TOLERANCE, fixture, flow, max_abs_diff

pytestmark = pytest.mark.parity


def check_stream_matches_upstream(case: Geometry, causal_finish: bool) -> None:
    data = fixture(case)
    x = data["inputs"]
    model, chunk = flow(case), case.hp.flow.dit.static_chunk_size
    stream = Flow3Stream(model, x["prompt_token"], x["prompt_feat"], x["embedding"])
    calls = stream_calls(case.prompt_tokens, case.tokens)
    done = 0  # tokens pushed (without look-ahead)
    for call, expected in zip(calls[:-1], data["stream_chunks"], strict=False):
        end = call.end - LOOKAHEAD
        mel = stream.push(x["token"][:, done:end], x["token"][:, end : call.end])
        done = end
        assert stream.cached_frames % chunk == 0
        diff = max_abs_diff(mel, expected)
        assert diff <= TOLERANCE, f"{call}: max abs diff {diff:.3g}"
    rest = x["token"][:, done:]
    if causal_finish:
        mel, expected = stream.push(rest, None), data["causal_last_chunk"]
    else:
        mel, expected = stream.finish(rest), data["stream_chunks"][-1]
    diff = max_abs_diff(mel, expected)
    assert diff <= TOLERANCE, f"last call: max abs diff {diff:.3g}"
    with pytest.raises(RuntimeError):
        stream.push(rest, None)


def test_only_the_frames_of_tokens_without_real_lookahead_change() -> None:
    """The pre-look-ahead convolutions give token ``i`` features from tokens ``i - 2 ..
    i + 3``. With the real look-ahead tokens as context every frame of a prefix is final;
    finishing with zeros instead changes exactly the last 3 tokens' (6 frames)."""
    x = fixture(TINY_CASE)["inputs"]
    model, token = flow(TINY_CASE), x["token"]
    whole = model.token_features(token, None)  # (1, 80, 480)
    with_context = model.token_features(token[:, :40], token[:, 40 : 40 + LOOKAHEAD])
    assert torch.equal(with_context, whole[:, :, :80])
    finished_early = model.token_features(token[:, :40], None)
    changed = (finished_early != whole[:, :, :80]).any(dim=1)[0].nonzero().flatten().tolist()
    assert changed == list(range(80 - 2 * LOOKAHEAD, 80))


def test_stream_matches_upstream_chunks() -> None:
    check_stream_matches_upstream(TINY_CASE, causal_finish=False)


def test_stream_with_chunk_causal_finish_matches_upstream() -> None:
    check_stream_matches_upstream(TINY_CASE, causal_finish=True)


def test_unaligned_pushes_match_whole_prefix_inference() -> None:
    """Pushes that end inside attention chunks recompute that chunk's frames and return
    what whole-prefix inference returns after the frames already returned."""
    x = fixture(TINY_CASE)["inputs"]
    model = flow(TINY_CASE)
    token, prompt_token, prompt_feat = x["token"][:, :80], x["prompt_token"][:, :7], x["prompt_feat"][:, :14]
    stream = Flow3Stream(model, prompt_token, prompt_feat, x["embedding"])
    done = 0
    for end in (4, 11, 40, 41, 60, 77):
        lookahead = token[:, end : end + LOOKAHEAD]
        mel = stream.push(token[:, done:end], lookahead)
        whole = model.inference(
            token[:, : end + LOOKAHEAD], prompt_token, prompt_feat, x["embedding"], True, False
        )
        assert mel.shape[2] == 2 * (end - done)
        assert max_abs_diff(mel, whole[:, :, 2 * done :]) <= TOLERANCE
        done = end
    assert stream.cached_frames == (14 + 2 * 77) // 50 * 50
    last = stream.push(token[:, done:], None)
    whole = model.inference(token, prompt_token, prompt_feat, x["embedding"], True, True)
    assert max_abs_diff(last, whole[:, :, 2 * done :]) <= TOLERANCE


@pytest.mark.slow
def test_full_geometry_stream_matches_upstream() -> None:
    check_stream_matches_upstream(FULL_CASE, causal_finish=False)
    check_stream_matches_upstream(FULL_CASE, causal_finish=True)
