"""Lossless cutting and packing of text into length-bounded pieces.

Shared by the sentence splitter (length = characters or tokens) and the normalizer
(which feeds wetext bounded chunks, because wetext's time grows faster than linearly
with input length). Every function here returns pieces that join back to its input.
"""

import re
from collections.abc import Callable

from cosyserve.frontend.text_tokens import COSYVOICE3_SPECIAL_TOKEN_RE

Measure = Callable[[str], int]

# Never cut inside a special token of either family (CosyVoice 3's list holds CosyVoice 2's).
_TOKEN_RE = COSYVOICE3_SPECIAL_TOKEN_RE
# Atoms of the last-resort cut: a special token is never cut in two.
_ATOM_RE = re.compile(f"{_TOKEN_RE.pattern}|.", re.DOTALL)


def cut_after(text: str, separator: re.Pattern[str]) -> list[str]:
    """Cut ``text`` after every match of ``separator`` (never inside a special token)."""
    inside = _token_interiors(text)
    pieces: list[str] = []
    start = 0
    for match in separator.finditer(text):
        end = match.end()
        if start < end < len(text) and end not in inside:
            pieces.append(text[start:end])
            start = end
    pieces.append(text[start:])
    return [piece for piece in pieces if piece]


def fit(text: str, measure: Measure, limit: int, separators: tuple[re.Pattern[str], ...]) -> list[str]:
    """Cut ``text`` into pieces that measure at most ``limit``.

    Cuts are tried after each separator in order of preference; what no separator can
    bring under the limit is cut between atoms, preferring positions that do not split a
    run of ASCII letters and digits. Only a single atom (one character or one special
    token) that measures more than ``limit`` is returned longer.
    """
    if measure(text) <= limit:
        return [text]
    for level, separator in enumerate(separators):
        pieces = cut_after(text, separator)
        if len(pieces) > 1:
            fitted = [
                part for piece in pieces for part in fit(piece, measure, limit, separators[level + 1 :])
            ]
            return pack(fitted, measure, limit)
    return _cut_atoms(text, measure, limit)


def pack(pieces: list[str], measure: Measure, limit: int) -> list[str]:
    """Greedily join neighbouring pieces while the joined piece measures at most ``limit``."""
    packed: list[str] = []
    for piece in pieces:
        if packed and measure(packed[-1] + piece) <= limit:
            packed[-1] += piece
        else:
            packed.append(piece)
    return packed


def _token_interiors(text: str) -> set[int]:
    return {i for match in _TOKEN_RE.finditer(text) for i in range(match.start() + 1, match.end())}


def _cut_atoms(text: str, measure: Measure, limit: int) -> list[str]:
    atoms = _ATOM_RE.findall(text)
    pieces: list[str] = []
    start = 0
    while start < len(atoms):
        count = _longest_fitting(atoms, start, measure, limit)
        count = _prefer_word_boundary(atoms, start, count)
        pieces.append("".join(atoms[start : start + count]))
        start += count
    return pieces


def _longest_fitting(atoms: list[str], start: int, measure: Measure, limit: int) -> int:
    """The largest count >= 1 with ``measure(atoms[start:start+count]) <= limit``.

    Galloping then bisecting keeps the number of ``measure`` calls logarithmic, which
    matters when ``measure`` runs a tokenizer.
    """

    def fits(count: int) -> bool:
        return measure("".join(atoms[start : start + count])) <= limit

    available = len(atoms) - start
    good, bad = 1, 2
    while bad <= available and fits(bad):
        good, bad = bad, bad * 2
    if bad > available:
        if fits(available):
            return available
        bad = available
    while bad - good > 1:
        middle = (good + bad) // 2
        if fits(middle):
            good = middle
        else:
            bad = middle
    return good


def _prefer_word_boundary(atoms: list[str], start: int, count: int) -> int:
    end = start + count
    if end >= len(atoms):
        return count
    # Look back at most half the piece, so that a boundary never leaves a tiny piece.
    for cut in range(end, start + max(1, count // 2) - 1, -1):
        if not (_is_word_char(atoms[cut - 1][-1]) and _is_word_char(atoms[cut][0])):
            return cut - start
    return count


def _is_word_char(char: str) -> bool:
    return char.isascii() and char.isalnum()
