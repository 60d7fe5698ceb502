"""Lossless sentence splitting with upstream's rules and lengths.

Upstream's ``split_paragraph`` (spec section 3.1) cuts after sentence punctuation and
greedily merges the sentences into synthesis segments. It can lose text (a second
punctuation mark in a row is dropped) and never bounds a segment. Here
``"".join(split_sentences(text, lang)) == text`` always holds, no segment is empty, and
a sentence longer than ``token_max_n`` is cut further: after commas, then after
whitespace, then between characters (never inside a special token).

Where we differ from upstream, on purpose:

* a run of punctuation stays with its sentence, and so do closing quotes or brackets
  and the whitespace that follow it;
* ``.`` and ``:`` followed by an ASCII letter or digit (``3.5``, ``e.g``, ``test.com``)
  do not end a sentence;
* no final punctuation is added; synthesis may append it;
* a merge never makes a segment longer than ``hard_max_n``.
"""

import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from cosyserve.frontend.text_pack import Measure, cut_after, fit

Language = Literal["zh", "en"]
TokenCount = Callable[[str], int]

_CLOSERS = re.escape("\"”’'」』）)》】]")
_SENTENCE_END = {
    "zh": re.compile(rf"(?:[。？！；：、?!;]|\.(?![A-Za-z0-9]))+[{_CLOSERS}]*\s*"),
    "en": re.compile(rf"(?:[?!;]|[.:](?![A-Za-z0-9]))+[{_CLOSERS}]*\s*"),
}
_FALLBACK_SEPARATORS = {
    "zh": (re.compile(r"[，,]+\s*"), re.compile(r"\s+")),
    "en": (re.compile(r",+\s*"), re.compile(r"\s+")),
}
# A stand-in for a BPE token count when no tokenizer is given: words, with long words
# counted once per 8 characters, and every other symbol counted once.
_APPROX_TOKEN_RE = re.compile(r"\w{1,8}|[^\w\s]")


@dataclass(frozen=True, slots=True)
class SplitOptions:
    """Segment lengths, in characters (zh) or tokens (en); defaults are upstream's."""

    token_max_n: int = 80
    token_min_n: int = 60
    # A final segment shorter than this is appended to the previous one.
    merge_len: int = 20
    # Upstream merges a segment of at most token_min_n with the next sentence even past
    # token_max_n; this bounds that merge.
    hard_max_n: int = 160

    def __post_init__(self) -> None:
        if not 0 < self.token_min_n <= self.token_max_n <= self.hard_max_n:
            raise ValueError("SplitOptions needs 0 < token_min_n <= token_max_n <= hard_max_n")
        if self.merge_len < 0:
            raise ValueError("SplitOptions.merge_len must not be negative")


def approx_token_count(text: str) -> int:
    """A rough token count for tests and for callers without a tokenizer."""
    return len(_APPROX_TOKEN_RE.findall(text))


def split_sentences(
    text: str,
    language: Language,
    token_count: TokenCount | None = None,
    options: SplitOptions | None = None,
) -> list[str]:
    """Split ``text`` into synthesis segments that join back to exactly ``text``.

    ``token_count`` measures English segments (pass the model tokenizer's
    ``lambda s: len(tokenizer.encode(s))``); it defaults to :func:`approx_token_count`.
    Chinese segments are measured in characters, as upstream does.
    """
    if not text:
        return []
    opts = options or SplitOptions()
    measure: Measure = len if language == "zh" else (token_count or approx_token_count)
    sentences = [
        piece
        for sentence in cut_sentences(text, language)
        for piece in fit(sentence, measure, opts.token_max_n, _FALLBACK_SEPARATORS[language])
    ]
    return _merge(sentences, measure, opts)


def cut_sentences(text: str, language: Language) -> list[str]:
    """Cut after every sentence end, with no length rules; the pieces join to ``text``."""
    return cut_after(text, _SENTENCE_END[language]) if text else []


def _merge(sentences: list[str], measure: Measure, opts: SplitOptions) -> list[str]:
    segments: list[str] = []
    current = ""
    for sentence in sentences:
        if current:
            joined = measure(current + sentence)
            upstream_cut = joined > opts.token_max_n and measure(current) > opts.token_min_n
            if upstream_cut or joined > opts.hard_max_n:
                segments.append(current)
                current = ""
        current += sentence
    if current:
        tail_joins = (
            bool(segments)
            and measure(current) < opts.merge_len
            and measure(segments[-1] + current) <= opts.hard_max_n
        )
        if tail_joins:
            segments[-1] += current
        else:
            segments.append(current)
    return segments


def is_speakable(segment: str) -> bool:
    """False when ``segment`` holds only punctuation, symbols, whitespace or controls.

    Upstream drops such segments before synthesis (``^[\\p{P}\\p{S}]*$``); whitespace is
    counted as unspeakable here too. Emoji are symbols, so an emoji-only segment is
    dropped, while a special token such as ``[breath]`` is speakable.
    """
    return any(unicodedata.category(char)[0] not in "PSZC" for char in segment)


def speakable_segments(segments: list[str]) -> list[str]:
    """The segments worth synthesizing (see :func:`is_speakable`), in order."""
    return [segment for segment in segments if is_speakable(segment)]
