"""Incremental streaming (:class:`Flow3Stream`) against upstream's streaming calls (the
committed flow fixtures) and against our own whole-prefix inference."""

import pytest
import torch

from cosyserve.models.dit import Flow3Stream, push_streams
from tests.models.cosyvoice3.make_flow_fixtures import FULL_CASE, LOOKAHEAD, TINY_CASE, Geometry, stream_calls
from tests.models.cosyvoice3.test_flow_parity import TOLERANCE, fixture, flow, max_abs_diff

pytestmark = pytest.mark.parity


def check_stream_matches_upstream(case: Geometry, causal_finish: bool, fixed_time: bool = False) -> None:
    data = fixture(case)
    x = data["inputs"]
    model, chunk = flow(case, fixed_time), case.hp.flow.dit.static_chunk_size
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


@pytest.mark.parametrize("fixed_time", [False, True])
def test_stream_matches_upstream_chunks(fixed_time: bool) -> None:
    check_stream_matches_upstream(TINY_CASE, causal_finish=False, fixed_time=fixed_time)


@pytest.mark.parametrize("fixed_time", [False, True])
def test_stream_with_chunk_causal_finish_matches_upstream(fixed_time: bool) -> None:
    check_stream_matches_upstream(TINY_CASE, causal_finish=True, fixed_time=fixed_time)


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
    check_stream_matches_upstream(FULL_CASE, causal_finish=False, fixed_time=True)
    check_stream_matches_upstream(FULL_CASE, causal_finish=True)


def _streams(
    case: Geometry, count: int, cache_dtype: torch.dtype | None = None
) -> tuple[list[Flow3Stream], torch.Tensor]:
    """``count`` streams of one prompt length (other voices: shifted prompt tokens, mel and
    speaker), and their tokens ``(count, N)``."""
    x = fixture(case)["inputs"]
    model = flow(case)
    streams = []
    for b in range(count):
        prompt_token = (x["prompt_token"] + 7 * b) % case.hp.flow.vocab_size
        voice = (prompt_token, x["prompt_feat"] + 0.1 * b, x["embedding"].roll(b, dims=1))
        streams.append(Flow3Stream(model, *voice, cache_dtype=cache_dtype))
    tokens = torch.stack([(x["token"][0] + 11 * b) % case.hp.flow.vocab_size for b in range(count)])
    return streams, tokens


# int8 rows round each cached value to one of 255 levels: a key computed a rounding error
# apart in a joint pass can land on the next level, a step of absmax / 127.
@pytest.mark.parametrize(("cache_dtype", "tol"), [(None, 1e-5), (torch.float16, 1e-5), (torch.int8, 1e-3)])
def test_streams_pushed_together_equal_each_pushed_alone(cache_dtype: torch.dtype | None, tol: float) -> None:
    together, tokens = _streams(TINY_CASE, 3, cache_dtype)
    alone, _ = _streams(TINY_CASE, 3, cache_dtype)
    done = 0
    # A short first push, then whole chunks, then the last.
    for stop, last in ((5, False), (30, False), (55, False), (80, False), (tokens.shape[1], True)):
        news = [tokens[b : b + 1, done:stop] for b in range(3)]
        lookaheads = [None if last else tokens[b : b + 1, stop : stop + LOOKAHEAD] for b in range(3)]
        got = push_streams(together, news, lookaheads)
        for b in range(3):
            want = alone[b].push(news[b], lookaheads[b])
            assert got[b].shape == want.shape
            assert max_abs_diff(got[b], want) <= tol, (stop, b)
            assert together[b].cached_frames == alone[b].cached_frames
        done = stop
    assert all(s.finished for s in together)


def test_pushes_out_of_lockstep_are_refused_and_a_failed_pass_changes_no_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    streams, tokens = _streams(TINY_CASE, 2)
    with pytest.raises(ValueError, match="equally many new frames"):
        push_streams(streams, [tokens[:1, :5], tokens[1:, :6]], [tokens[:1, 5:8], tokens[1:, 6:9]])
    news, lookaheads = [tokens[:1, :30], tokens[1:, :30]], [tokens[:1, 30:33], tokens[1:, 30:33]]
    model = flow(TINY_CASE)

    def broken(*args: object) -> torch.Tensor:
        raise RuntimeError("injected")

    with monkeypatch.context() as patch:
        patch.setattr(model.cfm.estimator, "forward", broken)
        with pytest.raises(RuntimeError, match="injected"):
            push_streams(streams, news, lookaheads)
    assert all(s.cached_frames == 0 and s.tokens.shape[1] == 0 for s in streams)
    again = push_streams(streams, news, lookaheads)
    fresh, _ = _streams(TINY_CASE, 2)
    for b in range(2):
        assert max_abs_diff(again[b], fresh[b].push(news[b], lookaheads[b])) <= 1e-5
