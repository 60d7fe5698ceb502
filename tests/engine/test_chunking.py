import itertools
import math

import pytest

from cosyserve.engine.chunking import Chunk, ChunkSchedule
from cosyserve.errors import InvalidRequestError


def _drain(schedule: ChunkSchedule, total: int) -> list[Chunk]:
    """Feed tokens one at a time, as an LM would, then finish."""
    chunks = []
    for available in range(total + 1):
        while (chunk := schedule.next_chunk(available, finished=False)) is not None:
            chunks.append(chunk)
    while (chunk := schedule.next_chunk(total, finished=True)) is not None:
        chunks.append(chunk)
    return chunks


def _upstream_offsets(
    prompt: int, total: int, hop: int = 25, lookahead: int = 3, max_hop: int | None = None
) -> list[tuple[int, int]]:
    """Upstream CosyVoice2Model.tts(stream=True) chunk calls, transcribed from the spec (7.1):
    with ``max_hop`` (its commit ace7c47 on) ``token_hop_len`` doubles after each chunk up
    to ``max_hop`` (one request's, not shared with the next)."""
    pad = math.ceil(prompt / hop) * hop - prompt
    calls, offset, token_hop_len = [], 0, hop
    while True:
        this_hop = token_hop_len + pad if offset == 0 else token_hop_len
        if total - offset >= this_hop + lookahead:
            calls.append((offset + this_hop + lookahead, offset))
            offset += this_hop
            if max_hop is not None:
                token_hop_len = min(max_hop, token_hop_len * 2)
            continue
        break
    calls.append((total, offset))
    return calls


@pytest.mark.parametrize("prompt", [0, 1, 24, 25, 26, 75, 87])
@pytest.mark.parametrize("total", [0, 10, 27, 28, 52, 53, 150])
def test_default_schedule_equals_upstream(prompt: int, total: int) -> None:
    chunks = _drain(ChunkSchedule(prompt), total)
    assert [(c.token_end, c.offset) for c in chunks] == _upstream_offsets(prompt, total)
    assert [c.finalize for c in chunks] == [False] * (len(chunks) - 1) + [True]


@pytest.mark.parametrize("prompt", [0, 1, 24, 25, 26, 75, 87])
@pytest.mark.parametrize("total", [0, 27, 28, 80, 81, 180, 181, 400])
def test_growing_schedule_equals_upstreams_doubling_hop(prompt: int, total: int) -> None:
    chunks = _drain(ChunkSchedule(prompt, max_hop=100), total)
    assert [(c.token_end, c.offset) for c in chunks] == _upstream_offsets(prompt, total, max_hop=100)


def test_the_growing_hop_is_each_requests_own() -> None:
    """Upstream kept the grown hop on the shared model: a second request started at 100."""
    first, second = _drain(ChunkSchedule(0, max_hop=100), 400), _drain(ChunkSchedule(0, max_hop=100), 400)
    assert [c.token_end - c.offset for c in first] == [c.token_end - c.offset for c in second]
    assert [c.token_end - c.offset for c in first[:4]] == [28, 53, 103, 103]


def test_the_hop_may_only_grow_to_a_whole_number_of_blocks() -> None:
    with pytest.raises(InvalidRequestError):
        ChunkSchedule(0, max_hop=60)


def test_every_token_is_emitted_once() -> None:
    chunks = _drain(ChunkSchedule(75, first_hop=10), 150)
    emitted = [c.offset for c in chunks] + [150]
    assert emitted[0] == 0
    assert all(b > a for a, b in itertools.pairwise(emitted))


def test_first_hop_cuts_early_then_realigns_to_blocks() -> None:
    chunks = _drain(ChunkSchedule(75, first_hop=10), 150)
    assert chunks[0] == Chunk(token_end=13, offset=0, finalize=False)
    # After the short first chunk the cursor returns to the 25-token grid from the prompt start.
    assert [(75 + c.offset) % 25 for c in chunks[1:-1]][1:] == [0] * (len(chunks) - 3)
    assert chunks[1].offset == 10 and chunks[2].offset == 25


def test_two_schedules_are_independent() -> None:
    first = _drain(ChunkSchedule(30), 120)
    second = _drain(ChunkSchedule(30), 120)
    assert first == second


@pytest.mark.parametrize("kwargs", [{"hop": 0}, {"lookahead": -1}, {"first_hop": 0}])
def test_invalid_parameters_are_rejected(kwargs: dict[str, int]) -> None:
    with pytest.raises(InvalidRequestError):
        ChunkSchedule(10, **kwargs)
