"""Chunks of several requests through the flow in one call (``infer_rows``,
``stream_rows``) give each request the frames it gets alone."""

import pytest
import torch

from cosyserve.engine.chunking import Chunk, ChunkSchedule
from cosyserve.modeldir.presets import TINY
from cosyserve.models.flow import Flow
from cosyserve.models.flow.rows import FlowRow, infer_rows, stream_rows
from cosyserve.models.flow.stream_cache import FlowStreamCache

_MEL_TOL = 1e-5


class Voice:
    """Random prompt tokens, prompt mel (2 frames per token), embedding and speech tokens."""

    def __init__(self, prompt: int, tokens: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        vocab = TINY.flow.vocab_size
        self.prompt_token = torch.randint(0, vocab, (prompt,), generator=gen)
        self.prompt_feat = torch.randn(2 * prompt, 80, generator=gen)
        self.embedding = torch.randn(192, generator=gen)
        self.tokens = torch.randint(0, vocab, (tokens,), generator=gen)

    def row(self, chunk: Chunk) -> FlowRow:
        return FlowRow(
            self.tokens[: chunk.token_end], self.prompt_token, self.prompt_feat, self.embedding, chunk.offset
        )

    def alone(self, flow: Flow, chunk: Chunk, streaming: bool) -> torch.Tensor:
        mel = flow.inference(
            self.tokens[None, : chunk.token_end],
            self.prompt_token[None],
            self.prompt_feat[None],
            self.embedding[None],
            streaming=streaming,
            finalize=chunk.finalize,
        )
        return mel[0, :, 2 * chunk.offset :]

    def stream_alone(self, flow: Flow, cache: FlowStreamCache, chunk: Chunk) -> torch.Tensor:
        row = self.row(chunk)
        mel = flow.stream(
            cache,
            row.token[None],
            row.prompt_token[None],
            row.prompt_feat[None],
            row.embedding[None],
            chunk.offset,
            chunk.finalize,
        )
        return mel[0]

    def chunks(self, first_hop: int | None = None) -> list[Chunk]:
        schedule = ChunkSchedule(self.prompt_token.shape[0], first_hop=first_hop)
        chunks = []
        while (chunk := schedule.next_chunk(self.tokens.shape[0], finished=True)) is not None:
            chunks.append(chunk)
        return chunks


VOICES = [(4, 30, 1), (13, 47, 2), (0, 21, 3), (31, 60, 4)]  # (prompt, tokens, seed)


def stream_in_lockstep(
    flow: Flow, voices: list[Voice], streams: list[list[Chunk]], caches: list[FlowStreamCache]
) -> tuple[list[list[torch.Tensor]], list[int]]:
    """Each voice's chunks through its cache, those of the streams holding as many cached
    tokens batched together at each step; each stream's mels, and each batch's size."""
    got: list[list[torch.Tensor]] = [[] for _ in voices]
    batches = []
    for step in range(max(map(len, streams))):
        live = [v for v in range(len(voices)) if step < len(streams[v])]
        groups: dict[tuple[int, bool], list[int]] = {}
        for v in live:
            groups.setdefault((caches[v].tokens, streams[v][step].finalize), []).append(v)
        for (_, finalize), members in groups.items():
            rows = [voices[v].row(streams[v][step]) for v in members]
            mels = stream_rows(flow, [caches[v] for v in members], rows, finalize=finalize)
            for v, mel in zip(members, mels, strict=True):
                got[v].append(mel)
            batches.append(len(members))
    return got, batches


def assert_close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.shape[1] > 0
        assert float((a - b).abs().max()) <= _MEL_TOL


@pytest.mark.parametrize("streaming", [False, True])
def test_final_chunks_of_different_lengths_and_voices_equal_each_alone(flow: Flow, streaming: bool) -> None:
    voices = [Voice(*v) for v in VOICES]
    chunks = [
        Chunk(token_end=v.tokens.shape[0], offset=o, finalize=True)
        for v, o in zip(voices, (0, 5, 0, 9), strict=True)
    ]
    got = infer_rows(
        flow, [v.row(c) for v, c in zip(voices, chunks, strict=True)], streaming=streaming, finalize=True
    )
    assert_close(got, [v.alone(flow, c, streaming) for v, c in zip(voices, chunks, strict=True)])


def test_exact_streaming_chunks_with_lookahead_equal_each_alone(flow: Flow) -> None:
    voices = [Voice(*v) for v in VOICES]
    # Intermediate chunks of different lengths: each row's look-ahead sits after its own end.
    chunks = [
        Chunk(token_end=end, offset=off, finalize=False) for end, off in ((24, 0), (40, 12), (11, 3), (31, 0))
    ]
    got = infer_rows(
        flow, [v.row(c) for v, c in zip(voices, chunks, strict=True)], streaming=True, finalize=False
    )
    assert_close(got, [v.alone(flow, c, True) for v, c in zip(voices, chunks, strict=True)])


def test_lockstep_streams_batched_equal_each_stream_alone(flow: Flow) -> None:
    voices = [Voice(4, 80, 5), Voice(13, 71, 6), Voice(20, 64, 7), Voice(25, 58, 8)]
    hops = [None, None, None, 6]  # the last stream's short first hop puts it out of step
    streams = [v.chunks(h) for v, h in zip(voices, hops, strict=True)]
    want = []
    for voice, chunks in zip(voices, streams, strict=True):
        cache = flow.new_stream_cache()
        want.append([voice.stream_alone(flow, cache, c) for c in chunks])

    caches = [flow.new_stream_cache() for _ in voices]
    got, batches = stream_in_lockstep(flow, voices, streams, caches)
    assert max(batches) >= 3  # really batched, final chunks of different lengths included
    for g, w in zip(got, want, strict=True):
        assert_close(g, w)
    assert all(c.finished and c.nbytes() == 0 for c in caches)


@pytest.mark.parametrize("compact", [False, True])
def test_streams_forked_from_a_primed_voice_batched_equal_each_alone(flow: Flow, compact: bool) -> None:
    # Forks read the primed prefix in place (their shared positions) and batch with each
    # other and with a stream that holds every position itself (compact: the streams keep
    # their own positions as the estimator layers' inputs).
    voices = [Voice(53, 70, 11), Voice(53, 70, 12), Voice(53, 70, 13)]
    for other in voices[1:2]:  # the first two: one voice, two requests
        other.prompt_token, other.prompt_feat, other.embedding = (
            voices[0].prompt_token,
            voices[0].prompt_feat,
            voices[0].embedding,
        )
    primed = flow.prime_stream(
        voices[0].prompt_token[None], voices[0].prompt_feat[None], voices[0].embedding[None]
    )
    assert primed.tokens == 50
    caches = [primed.fork(compact), primed.fork(compact), flow.new_stream_cache(compact)]
    caches[1].reserve(53 + 70, flow.token_mel_ratio)
    streams = [v.chunks() for v in voices]
    assert len({len(s) for s in streams}) == 1
    got: list[list[torch.Tensor]] = [[] for _ in voices]
    for step in range(len(streams[0])):
        # The first chunk: the forks start after the prefix, the third stream from nothing.
        for members in ([0, 1], [2]) if step == 0 else ([0, 1, 2],):
            rows = [voices[v].row(streams[v][step]) for v in members]
            mels = stream_rows(flow, [caches[v] for v in members], rows, finalize=streams[0][step].finalize)
            for v, mel in zip(members, mels, strict=True):
                got[v].append(mel)
    for voice, chunks, mels in zip(voices, streams, got, strict=True):
        alone = flow.new_stream_cache()
        assert_close(mels, [voice.stream_alone(flow, alone, c) for c in chunks])
    assert primed.tokens == 50 and not primed.finished


def test_a_failed_batched_pass_leaves_the_caches_as_they_were(
    flow: Flow, monkeypatch: pytest.MonkeyPatch
) -> None:
    voices = [Voice(4, 90, 9), Voice(13, 90, 10)]  # two intermediate chunks each
    streams = [v.chunks() for v in voices]
    caches = [flow.new_stream_cache() for _ in voices]
    first = [v.row(s[0]) for v, s in zip(voices, streams, strict=True)]
    stream_rows(flow, caches, first, finalize=False)
    real = flow.cfm.forward

    def broken(*args: object, **kwargs: object) -> torch.Tensor:
        real(*args, **kwargs)  # every layer has seen the pass
        raise RuntimeError("a kernel failed")

    monkeypatch.setattr(flow.cfm, "forward", broken)
    second = [v.row(s[1]) for v, s in zip(voices, streams, strict=True)]
    with pytest.raises(RuntimeError):
        stream_rows(flow, caches, second, finalize=False)
    monkeypatch.undo()
    got = [stream_rows(flow, [c], [row], finalize=False)[0] for c, row in zip(caches, second, strict=True)]
    want = []
    for voice, chunks in zip(voices, streams, strict=True):
        cache = flow.new_stream_cache()
        want.append([voice.stream_alone(flow, cache, c) for c in chunks[:2]][1])
    assert_close(got, want)


def test_batched_streams_must_be_in_step(flow: Flow) -> None:
    voices = [Voice(4, 90, 11), Voice(13, 90, 12)]
    caches = [flow.new_stream_cache() for _ in voices]
    first, second, *_ = voices[0].chunks()
    stream_rows(flow, caches[:1], [voices[0].row(first)], finalize=False)
    rows = [voices[0].row(second), voices[1].row(voices[1].chunks()[0])]
    with pytest.raises(ValueError, match="same number of cached tokens"):
        stream_rows(flow, caches, rows, finalize=False)
