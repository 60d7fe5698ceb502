"""Sentence-boundary buffering of streamed text (the WebSocket's input side)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cosyserve.server.text_buffer import SentenceBuffer


def _push_all(pieces: list[str], max_chars: int = 300) -> tuple[list[str], list[str]]:
    """(sentences handed out by the pushes, sentences handed out by the final flush)."""
    buffer = SentenceBuffer(max_chars)
    pushed = [s for piece in pieces for s in buffer.push(piece)]
    return pushed, buffer.flush()


@pytest.mark.parametrize(
    ("pieces", "pushed", "flushed"),
    [
        # English ends need the next character: a space confirms them.
        (["Hello there. How are", " you? Fine"], ["Hello there.", "How are you?"], ["Fine"]),
        (["Wait", "!", "?", " Ok"], ["Wait!?"], ["Ok"]),
        # A terminator at the end of the buffer waits (it could be 3.5).
        (["It costs 3."], [], ["It costs 3."]),
        (["It costs 3.", "5 dollars. Yes"], ["It costs 3.5 dollars."], ["Yes"]),
        (["See example.com now. Ok"], ["See example.com now."], ["Ok"]),
        (["Made in the U.S.A today; then home."], ["Made in the U.S.A today;"], ["then home."]),
        (["Ask Dr. Smith, e.g. now. Next"], ["Ask Dr. Smith, e.g. now."], ["Next"]),
        (["By J. K. Rowling. Next"], ["By J. K. Rowling."], ["Next"]),
        # Chinese ends; closing quotes stay with their sentence.
        (["你好。今天", "天气很好！明天呢？"], ["你好。", "今天天气很好！"], ["明天呢？"]),
        (["他说：“走吧。”然后走了；好"], ["他说：“走吧。”", "然后走了；"], ["好"]),
        (['He said "go." Then left'], ['He said "go."'], ["Then left"]),
        # An English end followed directly by Chinese.
        (["OK!好的。"], ["OK!"], ["好的。"]),
        # Newlines cut at once; punctuation-only pieces are dropped.
        (["line one\nline two\n"], ["line one", "line two"], []),
        (["Hi. ... ! Bye"], ["Hi."], ["Bye"]),
        (["   "], [], []),
    ],
)
def test_sentences(pieces: list[str], pushed: list[str], flushed: list[str]) -> None:
    assert _push_all(pieces) == (pushed, flushed)


def test_long_text_without_ends_is_cut_at_soft_breaks() -> None:
    words = "word " * 30  # 150 characters, no sentence end
    buffer = SentenceBuffer(max_chars=40)
    out = buffer.push(words)
    assert out and all(len(s) <= 40 for s in out)
    assert all(s.endswith("word") for s in out)  # cut at spaces, never inside a word
    assert " ".join([*out, *buffer.flush()]) == words.strip()


def test_long_text_without_breaks_is_cut_hard() -> None:
    buffer = SentenceBuffer(max_chars=10)
    assert buffer.push("x" * 25) == ["x" * 10, "x" * 10]
    assert buffer.flush() == ["x" * 5]


def test_clear_drops_the_pending_text() -> None:
    buffer = SentenceBuffer()
    buffer.push("unfinished sentence")
    assert buffer.pending == "unfinished sentence"
    buffer.clear()
    assert buffer.flush() == []


_ALPHABET = st.sampled_from(list('ab 3.5!?;,\n。，！”"D'))


@settings(max_examples=200, deadline=None)
@given(text=st.text(_ALPHABET, max_size=120), cuts=st.lists(st.integers(0, 120), max_size=8))
def test_piece_boundaries_do_not_change_the_sentences(text: str, cuts: list[int]) -> None:
    """However the text is split into pieces, the same sentences come out, with every
    letter and digit kept, in order."""
    points = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    whole = _push_all([text])
    split = _push_all(pieces)
    assert whole[0] + whole[1] == split[0] + split[1]
    kept = "".join(c for s in split[0] + split[1] for c in s if c.isalnum())
    assert kept == "".join(c for c in text if c.isalnum())
