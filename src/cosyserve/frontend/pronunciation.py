"""A pronunciation dictionary: words spoken the way the operator says, not as the model guesses.

The file is UTF-8 text, one entry a line: the word, white space, its pronunciation; ``#``
starts a comment. What a pronunciation may be depends on the model family:

- CosyVoice 3 reads pronunciation tokens inline (upstream's "hotfix" usage, ``[j][ǐ]``).
  An entry gives pinyin syllables with tone numbers (``chong2 qing4``; 5 or none for the
  neutral tone; ``v`` or ``ü`` for ü), ARPAbet phonemes (``HH AH0 L OW1``), or the tokens
  themselves (``[ch][óng]``); each becomes the tokens CosyVoice 3's tokenizer knows, and
  anything it does not know is an error naming the line.
- CosyVoice 2 has no such tokens: the pronunciation is replacement text (``重庆 崇庆``).

Application: leftmost, longest word first, never inside text a previous entry produced.
"""

import re
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from cosyserve.errors import CosyserveError
from cosyserve.frontend.text_tokens import COSYVOICE3_EXTRA_TOKENS

# Longest first: zh before z.
_INITIALS = ("zh", "ch", "sh", *"bpmfdtnlgkhjqxrzcsyw")
_TONE_MARKS = {"a": "āáǎà", "e": "ēéěè", "i": "īíǐì", "o": "ōóǒò", "u": "ūúǔù", "ü": "ǖǘǚǜ"}
_SYLLABLE_RE = re.compile(r"^([a-z]+?)([1-5]?)$")
_PHONEME_RE = re.compile(r"^[A-Z]{1,2}[0-2]?$")
_TOKEN_RE = re.compile(r"\[[^\[\]]+\]")
_COSYVOICE3_TOKENS = frozenset(COSYVOICE3_EXTRA_TOKENS)


class PronunciationError(CosyserveError):
    """The pronunciation file cannot be read or has an entry the model cannot speak."""

    code = "invalid_pronunciations"


@dataclass(frozen=True)
class Pronunciations:
    """word -> what replaces it in the text to speak (already in the model's form)."""

    entries: Mapping[str, str]

    @classmethod
    def empty(cls) -> "Pronunciations":
        return cls({})

    @classmethod
    def parse(cls, text: str, cosyvoice3: bool, source: str = "pronunciations") -> "Pronunciations":
        entries: dict[str, str] = {}
        for number, raw in enumerate(text.splitlines(), start=1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split(None, 1)
            if len(parts) != 2:
                raise PronunciationError(f"{source}:{number}: expected a word and its pronunciation")
            word, spoken = parts[0], parts[1].strip()
            try:
                entries[word] = to_cosyvoice3_tokens(spoken) if cosyvoice3 else spoken
            except ValueError as exc:
                raise PronunciationError(f"{source}:{number}: {word}: {exc}") from None
        return cls(entries)

    def apply(self, text: str) -> str:
        if self._pattern is None:
            return text
        return self._pattern.sub(lambda m: self.entries[m.group(0)], text)

    @cached_property
    def _pattern(self) -> re.Pattern[str] | None:
        """Every word, longest first: compiled once per dictionary, not per request."""
        if not self.entries:
            return None
        return re.compile("|".join(re.escape(w) for w in sorted(self.entries, key=len, reverse=True)))


def read_text(path: Path) -> str:
    """A dictionary file's text; :class:`PronunciationError` if it cannot be read."""
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PronunciationError(f"{path}: not readable ({exc.__class__.__name__})") from None


def to_cosyvoice3_tokens(spoken: str) -> str:
    """A pronunciation as CosyVoice 3 tokens; ValueError names what is not one."""
    spoken = unicodedata.normalize("NFC", spoken)
    if spoken.startswith("["):
        tokens = _TOKEN_RE.findall(spoken)
        if "".join(tokens) != spoken.replace(" ", ""):
            raise ValueError(f"{spoken!r} mixes tokens with other text")
    else:
        tokens = [_unit_tokens(unit) for unit in spoken.split()]
        tokens = [t for group in tokens for t in _TOKEN_RE.findall(group)]
    unknown = [t for t in tokens if t not in _COSYVOICE3_TOKENS]
    if unknown:
        raise ValueError(f"{', '.join(unknown)} is not a CosyVoice 3 pronunciation token")
    if not tokens:
        raise ValueError("empty pronunciation")
    return "".join(tokens)


def _unit_tokens(unit: str) -> str:
    if _PHONEME_RE.match(unit):
        return f"[{unit}]"
    match = _SYLLABLE_RE.match(unit.lower().replace("ü", "v"))
    if match is None:
        raise ValueError(f"{unit!r} is neither a pinyin syllable with a tone number nor an ARPAbet phoneme")
    letters, tone = match.groups()
    initial = next((i for i in _INITIALS if letters.startswith(i) and len(letters) > len(i)), "")
    final = letters[len(initial) :]
    # CosyVoice 3's units write ü as pinyin does: u after j, q, x, y; ü after l and n,
    # except üe, which is "ve".
    if final.startswith("v") and final != "ve":
        final = ("u" if initial in ("j", "q", "x", "y") else "ü") + final[1:]
    return (f"[{initial}]" if initial else "") + f"[{_mark_tone(final, int(tone) if tone else 5)}]"


def _mark_tone(final: str, tone: int) -> str:
    """Pinyin's rule: the mark goes on a or e, on the o of ou, else on the last vowel."""
    if tone == 5:
        return final
    if not 1 <= tone <= 4:
        raise ValueError(f"tone {tone} is not 1-5")
    vowels = [i for i, c in enumerate(final) if c in _TONE_MARKS]
    if not vowels:
        raise ValueError(f"{final!r} has no vowel")
    index = next((i for i, c in enumerate(final) if c in "ae"), None)
    if index is None:
        index = final.index("o") if "ou" in final else vowels[-1]
    return final[:index] + _TONE_MARKS[final[index]][tone - 1] + final[index + 1 :]
