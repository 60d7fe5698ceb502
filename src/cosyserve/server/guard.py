"""The input guard: what text and prompt audio the server accepts, on every transport.

Checks, in order: control characters (anything in Unicode category Cc but tab, newline
and carriage return) are refused with a stable 400; sensitive words from a list file,
matched by one Aho-Corasick pass (:mod:`~cosyserve.server.wordfilter`), either refuse the
request (``blocked_content``, 400) or are masked with ``*``. The word file is read at
start and again on :meth:`InputGuard.reload` (SIGHUP); a reload that fails keeps the old
list. Text length is checked by the routes (``max_text_chars``), upload size by the body
limit, and prompt duration by :attr:`max_prompt_audio_s`. Neither the text nor the
matched words are ever logged.
"""

import dataclasses
import logging
import threading
import unicodedata
from pathlib import Path
from typing import Literal

from cosyserve.errors import InvalidRequestError
from cosyserve.server.service import SpeechParams
from cosyserve.server.settings import Settings, SettingsError
from cosyserve.server.wordfilter import WordFilter, read_word_list

logger = logging.getLogger(__name__)

_ALLOWED_CONTROL = frozenset("\t\n\r")
MASK_CHAR = "*"


class ControlCharacterError(InvalidRequestError):
    code = "invalid_characters"


class BlockedContentError(InvalidRequestError):
    code = "blocked_content"


def _has_control(text: str) -> bool:
    return any(unicodedata.category(c) == "Cc" and c not in _ALLOWED_CONTROL for c in text)


class InputGuard:
    """``words_file``: the sensitive-word list ("" for none). ``action``: ``reject`` or
    ``mask``. ``max_prompt_audio_s``: the longest prompt recording."""

    def __init__(
        self,
        words_file: str = "",
        action: Literal["reject", "mask"] = "reject",
        max_prompt_audio_s: float = 30.0,
    ) -> None:
        self.words_file = words_file
        self.action = action
        self.max_prompt_audio_s = max_prompt_audio_s
        self._lock = threading.Lock()
        self._words = WordFilter(())
        if words_file:
            self._words = self._read()  # a missing file is a start-up error

    @classmethod
    def from_settings(cls, settings: Settings) -> "InputGuard":
        return cls(
            settings.sensitive_words_file, settings.sensitive_words_action, settings.max_prompt_audio_s
        )

    def _read(self) -> WordFilter:
        try:
            text = Path(self.words_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise SettingsError(f"cannot read sensitive_words_file {self.words_file}: {exc}") from None
        words = WordFilter(read_word_list(text))
        logger.info("sensitive words: %d loaded from %s", words.size, self.words_file)
        return words

    def reload(self) -> bool:
        """Read the word file again (SIGHUP); on failure keep the current list. True if
        the new list is in use."""
        if not self.words_file:
            return False
        try:
            words = self._read()
        except SettingsError as exc:
            logger.error("sensitive words not reloaded, the old list stays: %s", exc)
            return False
        with self._lock:
            self._words = words
        return True

    @property
    def word_count(self) -> int:
        return self._words.size

    def check_text(self, text: str, field: str) -> str:
        """``text`` as it may be synthesised (masked, if so configured), or a 400 error
        naming ``field`` but never the offending text."""
        if _has_control(text):
            raise ControlCharacterError(f"{field} contains control characters")
        words = self._words
        if not words.size:
            return text
        if self.action == "mask":
            return words.mask(text, MASK_CHAR)
        if words.contains(text):
            raise BlockedContentError(f"{field} contains words that are not allowed")
        return text

    def check_params(self, params: SpeechParams) -> SpeechParams:
        """Every text field of a synthesis request, checked (and masked)."""
        text = self.check_text(params.text, "text") if params.text else params.text
        instruct = self.check_text(params.instruct, "instruct") if params.instruct else params.instruct
        prompt = (
            self.check_text(params.prompt_text, "prompt_text") if params.prompt_text else params.prompt_text
        )
        if (text, instruct, prompt) == (params.text, params.instruct, params.prompt_text):
            return params
        return dataclasses.replace(params, text=text, instruct=instruct, prompt_text=prompt)
