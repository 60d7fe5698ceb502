"""A voice's primed stream cache (``Flow.prime_stream``) and its forks: streaming from a
fork equals streaming from an empty cache, and forks never disturb each other or the
primed cache."""

import pytest
import torch

from cosyserve.errors import InvalidRequestError
from cosyserve.models.flow import Flow
from cosyserve.models.flow.stream_cache import FlowStreamCache, LayerStates
from tests.models.flow.test_flow_incremental import Voice

_TOL = 1e-5


def _stream(flow: Flow, voice: Voice, cache: FlowStreamCache, first_hop: int | None) -> list[torch.Tensor]:
    return [voice.incremental(flow, cache, chunk) for chunk in voice.chunks(first_hop)]


@pytest.mark.parametrize(
    ("prompt", "first_hop", "prefix"),
    [
        (0, None, 0),  # no prompt
        (10, 4, 0),  # shorter than a block
        (25, None, 0),  # one block, but its last positions look ahead into generated tokens
        (50, None, 25),  # a multiple of the block: the last block is not the voice's alone
        (50, 3, 25),  # ... with a first hop that ends inside a block
        (53, None, 50),  # not a multiple, look-ahead within the prompt
        (53, 40, 50),  # ... first hop ending 18 tokens into a block
        (79, 6, 75),
    ],
)
def test_streaming_from_a_fork_equals_streaming_from_an_empty_cache(
    flow: Flow, prompt: int, first_hop: int | None, prefix: int
) -> None:
    voice = Voice(prompt, 80, seed=100 + prompt)
    primed = flow.prime_stream(voice.prompt_token, voice.prompt_feat, voice.embedding)
    assert primed.tokens == prefix == flow.voice_prefix(prompt, 2 * prompt)
    assert (primed.nbytes() > 0) == (prefix > 0)
    want = _stream(flow, voice, flow.new_stream_cache(), first_hop)
    got = _stream(flow, voice, primed.fork(), first_hop)
    assert len(got) == len(want) >= 3
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.shape[2] > 0
        assert float((a - b).abs().max()) <= _TOL


def test_the_first_chunk_from_a_fork_computes_only_the_frames_after_the_prefix(flow: Flow) -> None:
    voice = Voice(53, 60, seed=1)
    primed = flow.prime_stream(voice.prompt_token, voice.prompt_feat, voice.embedding)
    widths: list[int] = []
    hook = flow.cfm.estimator.register_forward_hook(lambda _m, args, _out: widths.append(args[0].shape[2]))
    try:
        first = next(voice.chunks())
        voice.incremental(flow, primed.fork(), first)
    finally:
        hook.remove()
    # Prompt + first hop (padded to at least one hop) end on the block boundary at 100
    # tokens; 50 were primed, so half the frames of an unprimed first chunk remain.
    assert first.token_end == 47 + 3
    assert widths == [2 * (100 - 50)] * len(primed.steps)


def test_forks_used_interleaved_leave_each_other_and_the_primed_cache_alone(flow: Flow) -> None:
    voice = Voice(57, 70, seed=2)
    other = Voice(57, 70, seed=3)  # another request of the same voice: other generated tokens
    other.prompt_token, other.prompt_feat, other.embedding = (
        voice.prompt_token,
        voice.prompt_feat,
        voice.embedding,
    )
    primed = flow.prime_stream(voice.prompt_token, voice.prompt_feat, voice.embedding)
    snapshot = [t.clone() for t in primed.tensors()]
    tokens, nbytes = primed.tokens, primed.nbytes()
    alone = [_stream(flow, v, flow.new_stream_cache(), hop) for v, hop in ((voice, 5), (other, None))]

    forks = [primed.fork(), primed.fork()]
    # Nothing is copied up front: the forks read the primed tensors themselves.
    shared = {t.data_ptr() for t in primed.tensors()}
    assert all({t.data_ptr() for t in fork.tensors()} == shared for fork in forks)
    streams = [list(voice.chunks(5)), list(other.chunks())]
    together: list[list[torch.Tensor]] = [[], []]
    for i in range(max(map(len, streams))):
        for s, (v, fork) in enumerate(zip((voice, other), forks, strict=True)):
            if i < len(streams[s]):
                together[s].append(v.incremental(flow, fork, streams[s][i]))

    for got, want in zip(together, alone, strict=True):
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            assert float((a - b).abs().max()) <= _TOL
    assert primed.tokens == tokens and primed.nbytes() == nbytes and not primed.finished
    after = primed.tensors()
    assert len(after) == len(snapshot)
    assert all(torch.equal(a, b) for a, b in zip(after, snapshot, strict=True))
    # And a later fork still starts the stream correctly.
    late = _stream(flow, voice, primed.fork(), 5)
    assert all(float((a - b).abs().max()) <= _TOL for a, b in zip(late, alone[0], strict=True))


def test_voice_prefix(flow: Flow) -> None:
    assert flow.stream_block == 25 and flow.pre_lookahead_len == 3
    cases = {(0, 0): 0, (27, 54): 0, (28, 56): 25, (52, 104): 25, (53, 106): 50, (200, 400): 175}
    for (tokens, frames), prefix in cases.items():
        assert flow.voice_prefix(tokens, frames) == prefix
    # A prompt mel shorter than its tokens bounds the prefix: its frames are never emitted.
    assert flow.voice_prefix(200, 60) == 25


def test_whole_voice_prefix_takes_every_whole_block_of_the_prompt(flow: Flow) -> None:
    cases = {(0, 0): 0, (24, 48): 0, (25, 50): 25, (27, 54): 25, (50, 100): 50, (53, 106): 50}
    for (tokens, frames), prefix in cases.items():
        assert flow.voice_prefix(tokens, frames, whole=True) == prefix
    assert flow.voice_prefix(200, 60, whole=True) == 25  # still within the prompt's mel


@pytest.mark.parametrize(("prompt", "first_hop"), [(53, None), (79, 6)])
def test_whole_priming_is_exact_when_the_look_ahead_stays_in_the_prompt(
    flow: Flow, prompt: int, first_hop: int | None
) -> None:
    voice = Voice(prompt, 60, seed=200 + prompt)
    primed = flow.prime_stream(voice.prompt_token, voice.prompt_feat, voice.embedding, whole=True)
    assert primed.tokens == flow.voice_prefix(prompt, 2 * prompt)
    want = _stream(flow, voice, flow.new_stream_cache(), first_hop)
    got = _stream(flow, voice, primed.fork(), first_hop)
    assert all(float((a - b).abs().max()) <= _TOL for a, b in zip(got, want, strict=True))


def test_whole_priming_leaves_the_first_chunk_only_its_own_frames(flow: Flow) -> None:
    voice = Voice(50, 60, seed=5)  # ends on a block boundary, as a 3 s prompt of 75 does
    primed = flow.prime_stream(voice.prompt_token, voice.prompt_feat, voice.embedding, whole=True)
    assert primed.tokens == 50
    cache = primed.fork()
    widths: list[int] = []
    hook = flow.cfm.estimator.register_forward_hook(lambda _m, args, _out: widths.append(args[0].shape[2]))
    try:
        got = [voice.incremental(flow, cache, chunk) for chunk in voice.chunks(5)]
    finally:
        hook.remove()
    assert widths[: len(primed.steps)] == [2 * 5] * len(primed.steps)  # not 2 * (25 + 5)
    want = _stream(flow, voice, flow.new_stream_cache(), 5)
    # The prompt's last block saw zeros, not the first 3 tokens, as look-ahead: every chunk
    # differs a little (it attends to that block), and no more than the output's own scale.
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        assert 0 < float((a - b).abs().mean()) < 0.5 * float(b.abs().mean())


def test_prime_stream_checks_its_inputs(flow: Flow) -> None:
    voice = Voice(40, 1, seed=4)
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        flow.prime_stream(voice.prompt_token + 10**6, voice.prompt_feat, voice.embedding)
    with pytest.raises(InvalidRequestError, match="shapes"):
        flow.prime_stream(voice.prompt_token, voice.prompt_feat, voice.embedding[:, :5])
    finished = flow.new_stream_cache()
    finished.finish(0, finalize=True)
    with pytest.raises(ValueError, match="finalized"):
        finished.fork()


def test_a_fork_of_states_with_slack_reallocates_instead_of_writing_into_it() -> None:
    layer = torch.nn.Identity()
    states = LayerStates()
    for n in (4, 3, 1):  # buffers of 4, 7, then 10 positions for 8
        states.begin(n)
        states.attend(layer, torch.randn(1, 2, n, 8), torch.randn(1, 2, n, 8))
        states.finish()
    keys, values = states.tensors()
    assert keys.shape[2] == 10 and states.length == 8  # slack a naive fork would write into
    before = keys.clone(), values.clone()
    fork = states.fork()
    fork.begin(1)
    fork_keys, _ = fork.attend(layer, torch.ones(1, 2, 1, 8), torch.ones(1, 2, 1, 8))
    fork.finish()
    assert torch.equal(keys, before[0]) and torch.equal(values, before[1])
    assert torch.equal(fork_keys[:, :, :8], keys[:, :, :8]) and bool((fork_keys[:, :, 8] == 1).all())


def test_a_fork_of_a_fork_holds_every_cached_position() -> None:
    layer = torch.nn.Identity()
    states = LayerStates()
    keys = torch.randn(1, 2, 6, 8)
    states.begin(4)
    states.attend(layer, keys[:, :, :4], keys[:, :, :4])
    states.finish()
    fork = states.fork()
    assert fork.fork().shared == 4  # a fork that has not run a pass forks its shared positions
    fork.begin(2)
    fork.attend(layer, keys[:, :, 4:], keys[:, :, 4:])
    fork.finish()
    again = fork.fork()
    again.begin(0)
    got, _ = again.attend(layer, torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8))
    assert again.shared == 6 and torch.equal(got[:, :, :6], keys) and bool((got[:, :, 6] == 0).all())


def test_compact_states_refuse_a_layer_that_cannot_recompute_its_keys() -> None:
    states = LayerStates(compact=True)
    states.begin(2)
    k = torch.randn(1, 2, 2, 8)
    with pytest.raises(TypeError, match="Identity cannot recompute its keys and values"):
        states.attend(torch.nn.Identity(), k, k, torch.randn(1, 2, 16))
