"""Sentence splitting: upstream's segments on ordinary text, and never losing text."""

import re

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from cosyserve.errors import InvalidRequestError
from cosyserve.frontend import (
    NOTHING_TO_SPEAK,
    SPECIAL_TOKENS,
    Language,
    SplitOptions,
    TextNormalizer,
    approx_token_count,
    cut_sentences,
    is_speakable,
    normalize_and_split,
    speakable_segments,
    split_sentences,
)
from cosyserve.frontend.text_pack import fit
from cosyserve.frontend.text_tokens import SPECIAL_TOKEN_RE
from tests.upstream import upstream

SMALL = SplitOptions(token_max_n=6, token_min_n=4, merge_len=3, hard_max_n=10)
PROPERTY_SETTINGS = settings(max_examples=200, deadline=None)


def _word_count(text: str) -> int:
    return len(text.split())


@pytest.mark.parametrize(
    ("text", "sentences"),
    [
        ("你好。世界！再见", ["你好。", "世界！", "再见"]),
        ("他说：“走。”然后", ["他说：", "“走。”", "然后"]),  # the closing quote stays with its sentence
        ("真的？！。。好", ["真的？！。。", "好"]),  # upstream drops the second mark of a run
        ("一、二、三", ["一、", "二、", "三"]),
        ("它是3.5版.好", ["它是3.5版.", "好"]),
    ],
)
def test_zh_sentences_end_after_sentence_punctuation(text: str, sentences: list[str]) -> None:
    assert cut_sentences(text, "zh") == sentences


@pytest.mark.parametrize(
    ("text", "sentences"),
    [
        (
            "Hi. Bye!  Ok: fine",
            ["Hi. ", "Bye!  ", "Ok: ", "fine"],
        ),  # whitespace stays with the sentence before
        ("It is 3.5 now. e.g. this", ["It is 3.5 now. ", "e.g. ", "this"]),  # "." inside a word
        ("see test.com at 14:30 today", ["see test.com at 14:30 today"]),
        ('He said "go." Then (left.) ok', ['He said "go." ', "Then (left.) ", "ok"]),
    ],
)
def test_en_sentences_end_after_sentence_punctuation(text: str, sentences: list[str]) -> None:
    assert cut_sentences(text, "en") == sentences


def test_no_final_punctuation_is_added() -> None:
    assert split_sentences("hello world", "en") == ["hello world"]
    assert split_sentences("你好", "zh") == ["你好"]
    assert split_sentences("", "zh") == []


def test_greedy_merge_uses_upstream_lengths() -> None:
    sentence = "一二三四五六七八九。"  # 10 characters
    segments = split_sentences(sentence * 20, "zh")
    # Merge while <= 80, or while the current segment is <= 60: 70 + 10 = 80 merges, 80 + 10 cuts.
    assert [len(s) for s in segments] == [80, 80, 40]


def test_a_short_tail_joins_the_previous_segment() -> None:
    assert [len(s) for s in split_sentences("一二三四五六七八九。" * 16 + "好。", "zh")] == [80, 82]


def test_en_lengths_come_from_the_token_count() -> None:
    calls: list[str] = []

    def count(text: str) -> int:
        calls.append(text)
        return len(text)  # one token per character

    segments = split_sentences("Aaaa. Bbbb. Cccc.", "en", count, SMALL)
    assert segments == ["Aaaa. ", "Bbbb. ", "Cccc."]
    assert calls


def test_fit_cuts_at_commas_then_spaces_then_characters() -> None:
    separators = (re.compile(r"[，,]+\s*"), re.compile(r"\s+"))
    assert fit("一二三，四五六七八九十", len, 6, separators) == ["一二三，", "四五六七八九", "十"]
    assert fit("aa bb cc dd ee ff gg", _word_count, 3, separators) == ["aa bb cc ", "dd ee ff ", "gg"]
    assert fit("你" * 13, len, 6, separators) == ["你" * 6, "你" * 6, "你"]


def test_hard_cut_avoids_splitting_an_ascii_word_and_never_splits_a_token() -> None:
    assert fit("你好你abcdefgh", len, 6, ()) == ["你好你", "abcdef", "gh"]
    assert fit("[breath]" * 5, len, 10, ()) == ["[breath]"] * 5
    assert fit("[breath]" * 5, len, 3, ()) == ["[breath]"] * 5


def test_10000_characters_without_punctuation_stay_bounded() -> None:
    zh = "这是一段没有标点的很长的文字" * 800
    en = " ".join(["word"] * 2500)
    blob = "x" * 12_000
    for text, language in ((zh, "zh"), (en, "en"), (blob, "en")):
        segments = split_sentences(text, language)  # type: ignore[arg-type]
        assert "".join(segments) == text
        measure = len if language == "zh" else approx_token_count
        assert max(measure(s) for s in segments) <= 80


@st.composite
def _any_text(draw: st.DrawFn) -> str:
    pieces = st.one_of(
        st.text(max_size=30),
        st.text(st.sampled_from(list('你好世界。？！；：、，,.?!;:"”’」）) \n\tabc123😀🎉')), max_size=40),
        st.sampled_from(SPECIAL_TOKENS),
        st.just("<|en|>"),
    )
    return "".join(draw(st.lists(pieces, max_size=12)))


@PROPERTY_SETTINGS
@given(text=_any_text(), language=st.sampled_from(["zh", "en"]), small=st.booleans())
@example(text="", language="zh", small=False)
@example(text="。！？" * 50, language="zh", small=False)
@example(text="长" * 10_001, language="zh", small=False)
@example(text="no punctuation at all " * 600, language="en", small=False)
@example(text="😀" * 200 + "[breath]" * 30, language="en", small=True)
def test_split_is_lossless_non_empty_and_bounded(text: str, language: Language, small: bool) -> None:
    options = SMALL if small else SplitOptions()
    segments = split_sentences(text, language, options=options)
    assert "".join(segments) == text
    assert all(segments)
    measure = len if language == "zh" else approx_token_count
    for segment in segments:
        single_atom = SPECIAL_TOKEN_RE.fullmatch(segment) is not None or len(segment) == 1
        assert measure(segment) <= options.hard_max_n or single_atom
    # No special token is cut between segments.
    spans = [(m.start(), m.end()) for m in SPECIAL_TOKEN_RE.finditer(text)]
    cuts = {sum(len(s) for s in segments[:i]) for i in range(1, len(segments))}
    assert not any(start < cut < end for start, end in spans for cut in cuts)


@PROPERTY_SETTINGS
@given(text=_any_text(), limit=st.integers(1, 12))
def test_fit_pieces_respect_the_limit_unless_a_single_atom(text: str, limit: int) -> None:
    pieces = fit(text, approx_token_count, limit, (re.compile(r",\s*"), re.compile(r"\s+"))) if text else []
    assert "".join(pieces) == text
    for piece in pieces:
        assert approx_token_count(piece) <= limit or len(piece) == 1 or SPECIAL_TOKEN_RE.fullmatch(piece)


_ZH_SENTENCE = st.builds(
    lambda body, mark: body + mark,
    st.text(st.sampled_from(list("天地玄黄宇宙洪荒日月盈昃")), min_size=1, max_size=79),
    st.sampled_from(list("。？！；：、.?!;")),
)
_EN_SENTENCE = st.builds(
    lambda words, mark: " ".join(words) + mark,
    st.lists(st.sampled_from(["alpha", "beta", "gamma", "delta"]), min_size=1, max_size=79),
    st.sampled_from(list(".?!;:")),
)


@PROPERTY_SETTINGS
@given(st.lists(_ZH_SENTENCE, min_size=1, max_size=30))
def test_zh_segments_match_upstream_split_paragraph(sentences: list[str]) -> None:
    text = "".join(sentences)
    split_paragraph = upstream("cosyvoice.utils.frontend_utils").split_paragraph
    expected = split_paragraph(text, None, "zh", token_max_n=80, token_min_n=60, merge_len=20)
    assert split_sentences(text, "zh") == expected


@PROPERTY_SETTINGS
@given(st.lists(_EN_SENTENCE, min_size=1, max_size=30))
def test_en_segments_match_upstream_split_paragraph(sentences: list[str]) -> None:
    text = " ".join(sentences)
    split_paragraph = upstream("cosyvoice.utils.frontend_utils").split_paragraph
    expected = split_paragraph(text, str.split, "en", token_max_n=80, token_min_n=60, merge_len=20)
    # Upstream starts each sentence with the space after the previous one; we end with it.
    assert [s.strip() for s in split_sentences(text, "en", _word_count)] == [s.strip() for s in expected]


@pytest.mark.parametrize(
    ("segment", "speakable"),
    [
        ("。！", False),
        (" \n", False),
        ("😀🎉", False),
        ("", False),
        ("[breath]", True),
        ("a", True),
        ("你", True),
    ],
)
def test_is_speakable(segment: str, speakable: bool) -> None:
    assert is_speakable(segment) is speakable


def test_speakable_segments_keeps_order() -> None:
    assert speakable_segments(["你好。", "。。", "再见"]) == ["你好。", "再见"]


@pytest.fixture(scope="module")
def normalizer() -> TextNormalizer:
    return TextNormalizer()


def test_normalize_and_split(normalizer: TextNormalizer) -> None:
    text = "价格￥128.50元。" * 8 + "电话555-1234。"
    segments = normalize_and_split(text, normalizer=normalizer)
    assert "".join(segments) == normalizer.normalize(text)
    assert all(len(s) <= 80 for s in segments) and len(segments) == 2
    assert normalize_and_split("It costs $3. Call 555-1234.", str.__len__, normalizer=normalizer) == [
        "It costs three dollars. Call five five five one two three four."
    ]
    assert normalizer.normalize_and_split(text) == segments


@pytest.mark.parametrize("text", ["", "   ", "。。。", "😀🎉", "!!! ???"])
def test_nothing_to_speak_is_an_empty_list_or_an_invalid_request(
    normalizer: TextNormalizer, text: str
) -> None:
    assert normalize_and_split(text, normalizer=normalizer) == []
    with pytest.raises(InvalidRequestError, match=NOTHING_TO_SPEAK):
        normalize_and_split(text, normalizer=normalizer, raise_if_empty=True)
