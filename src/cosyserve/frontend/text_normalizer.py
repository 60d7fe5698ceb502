"""Chinese and English text normalization on top of wetext, with our fixes around it.

Pipeline of :meth:`TextNormalizer.normalize`:

1. input hygiene (``text_cleanup.clean_input``) and language choice as upstream;
2. special tokens (the model family's list, see :class:`TextNormalizer`), and the
   characters wetext escapes or fails on, are cut out as protected spans and pass through
   unchanged (upstream skips normalization of any text with ``<|`` and ``|>`` instead);
3. each plain span: table-driven fixes (``text_fixes_zh`` / ``text_fixes_en``), then
   wetext on line-free chunks of at most 200 characters (wetext's time grows faster than
   linearly: 10,000 characters take seconds in one call);
4. upstream's per-language post-processing (``text_cleanup``), which for English (digits
   spelled out) skips the special tokens: CosyVoice 3's ``[AH0]`` keeps its stress digit.
   Upstream spells it out (``[AHzero]``, no longer a token) unless its text frontend is off.
"""

import logging
import re
import threading
from collections.abc import Sequence
from typing import Any, Protocol

from cosyserve.frontend.sentence_splitter import (
    Language,
    SplitOptions,
    TokenCount,
    speakable_segments,
    split_sentences,
)
from cosyserve.frontend.text_cleanup import clean_input, postprocess_en, postprocess_zh
from cosyserve.frontend.text_fixes import Fix, apply_fixes
from cosyserve.frontend.text_fixes_en import EN_FIXES
from cosyserve.frontend.text_fixes_zh import ZH_FIXES
from cosyserve.frontend.text_numbers import zh_cardinal, zh_digits
from cosyserve.frontend.text_pack import fit
from cosyserve.frontend.text_tokens import SPECIAL_TOKENS, special_token_re, split_protected

logger = logging.getLogger(__name__)

_CJK_RE = re.compile(r"[\u4e00-\u9fff]")
# wetext serializes its tokens with quotes, backslashes and braces: '"' and '\' come back
# backslash-escaped, and '{' or '}' make it raise. They never need normalizing.
_WETEXT_UNSAFE = r'|["\\{}]'
_LINE_BREAK_RE = re.compile(r"(\s*\n\s*)")
_CHUNK_CHARS = 200
_CHUNK_SEPARATORS = (re.compile(r"[。！？；!?;]+\s*|[.:,，、](?=\s)\s*"), re.compile(r"\s+"))
_WORD_RE = re.compile(r"(\s+)")
_DIGITS_RE = re.compile(r"\d+")


class _Wetext(Protocol):
    def normalize(self, text: str) -> str: ...


class TextNormalizer:
    """Normalizes text for synthesis; construct once and share.

    wetext and inflect are imported on first use: wetext loads all of its FSTs then
    (about 0.4 s and 45 MB, shared by every instance in the process), and inflect's import
    instruments its functions with typeguard (2-5 s on a busy 2-core machine).
    :meth:`warmup` does both up front.
    Thread safety: one instance may be used from many threads. Lazy loading and every
    call into wetext and inflect hold the instance's lock: inflect keeps per-call state
    on its engine, and wetext's FST calls hold the GIL for their whole run anyway, so
    the lock costs no parallelism. Because of that GIL hold, run long texts off the
    event loop.
    """

    def __init__(self, special_tokens: Sequence[str] = SPECIAL_TOKENS) -> None:
        """``special_tokens``: the tokenizer's, kept intact: ``text_tokens.SPECIAL_TOKENS``
        (CosyVoice 2, the default) or ``text_tokens.COSYVOICE3_SPECIAL_TOKENS``."""
        self._tokens_re = special_token_re(tuple(special_tokens))
        self._protected_re = re.compile(self._tokens_re.pattern + _WETEXT_UNSAFE)
        self._lock = threading.Lock()
        self._wetext: dict[Language, _Wetext] = {}
        self._inflect: Any = None

    def language(self, text: str) -> Language:
        """``"zh"`` when the text has any CJK ideograph (U+4E00-U+9FFF), else ``"en"``."""
        return "zh" if _CJK_RE.search(text) else "en"

    def warmup(self) -> None:
        """Load wetext (both languages) and inflect now instead of on the first request."""
        for language in ("zh", "en"):
            self._wetext_for(language)
        self._en_cardinal(0)

    def normalize(self, text: str) -> str:
        """The text as it should be spoken; ``""`` if nothing is left."""
        text = clean_input(text).strip()
        if not text:
            return ""
        language = self.language(text)
        fixes = ZH_FIXES if language == "zh" else EN_FIXES
        joined = "".join(
            span.text if span.protected else self._normalize_plain(span.text, language, fixes)
            for span in split_protected(text, self._protected_re)
        )
        if language == "zh":
            # No special token holds what these steps change (spaces, dots, digits, brackets).
            return postprocess_zh(joined).strip()
        return "".join(
            span.text if span.protected else postprocess_en(span.text, self._en_cardinal)
            for span in split_protected(joined, self._tokens_re)
        ).strip()

    def normalize_and_split(
        self, text: str, token_count: TokenCount | None = None, options: SplitOptions | None = None
    ) -> list[str]:
        """Normalize, split into synthesis segments, drop unspeakable ones; ``[]`` if none is left.

        ``token_count`` measures English segments (the model tokenizer's token count).
        """
        segments = split_sentences(self.normalize(text), self.language(text), token_count, options)
        return speakable_segments(segments)

    def _normalize_plain(self, text: str, language: Language, fixes: tuple[Fix, ...]) -> str:
        text = apply_fixes(text, fixes, self._en_cardinal)
        out: list[str] = []
        # Line breaks never reach wetext: its English grammar fails on blank lines.
        for part in _LINE_BREAK_RE.split(text):
            if not part.strip():
                out.append(part)
                continue
            for chunk in fit(part, len, _CHUNK_CHARS, _CHUNK_SEPARATORS):
                out.append(self._normalize_chunk(chunk, language))
        return "".join(out)

    def _normalize_chunk(self, chunk: str, language: Language) -> str:
        core = chunk.strip()
        if not core:
            return chunk
        # wetext strips its input; the whitespace around a chunk separates it from its
        # neighbours and must stay.
        lead = chunk[: len(chunk) - len(chunk.lstrip())]
        trail = chunk[len(chunk.rstrip()) :]
        try:
            spoken = self._run_wetext(core, language)
        # wetext is a third-party grammar that raises (mostly AssertionError) on input it
        # cannot tag; one bad chunk must degrade, not fail the request.
        except Exception as error:
            logger.warning(
                "wetext failed (%s) on a %d-character %s chunk; retrying word by word",
                type(error).__name__,
                len(core),
                language,
            )
            spoken = "".join(self._normalize_word(word, language) for word in _WORD_RE.split(core))
        return lead + spoken + trail

    def _normalize_word(self, word: str, language: Language) -> str:
        if not word.strip() or not _DIGITS_RE.search(word):
            return word
        try:
            return self._run_wetext(word, language)
        except Exception:
            # English digits are spelled out by the post-processing; Chinese ones here.
            return word if language == "en" else _DIGITS_RE.sub(_zh_number, word)

    def _run_wetext(self, text: str, language: Language) -> str:
        normalizer = self._wetext_for(language)
        with self._lock:
            return normalizer.normalize(text)

    def _wetext_for(self, language: Language) -> _Wetext:
        normalizer = self._wetext.get(language)
        if normalizer is not None:
            return normalizer
        with self._lock:
            if language not in self._wetext:
                from wetext import Normalizer

                self._wetext[language] = Normalizer(lang=language, operator="tn", remove_erhua=False)
            return self._wetext[language]

    def _en_cardinal(self, number: int) -> str:
        """English words for a non-negative integer, without "and", hyphens or commas."""
        with self._lock:
            if self._inflect is None:
                import inflect

                self._inflect = inflect.engine()
            words = self._inflect.number_to_words(number, andword="", comma="")
        return str(words).replace("-", " ")


def _zh_number(match: re.Match[str]) -> str:
    digits = match.group()
    if len(digits) > 1 and digits.startswith("0"):
        return zh_digits(digits)
    return zh_cardinal(int(digits))
