"""Input hygiene before normalization and the per-language steps after wetext.

The post-processing follows upstream's ``text_normalize`` (spec section 3.1) step by
step; where we differ, the comment says why. None of these steps can change a special
token (no token contains a space, digit, "." or the removed brackets), so they run on the
whole normalized text.
"""

import re

from cosyserve.frontend.text_fixes import EnCardinal
from cosyserve.frontend.text_numbers import en_digits

_LINE_BREAKS = re.compile(r"\r\n?")
_OTHER_BLANKS = re.compile(r"[\t\v\f]")
# Invisible characters that make wetext's English grammar fail (zero-width space, BOM,
# direction marks) or that no speaker reads (C0 controls). The zero-width joiner stays:
# it is part of emoji sequences.
_INVISIBLE = re.compile(r"[\x00-\x08\x0e-\x1f\x7f\u200b\u200c\u200e\u200f\u2060\ufeff]")
_FULLWIDTH_DIGITS = str.maketrans("０１２３４５６７８９", "0123456789")
_LINE_RUN = re.compile(r"\s*\n\s*")

# A space survives only between two printable, non-space ASCII characters (upstream's
# replace_blank): it separates English words, never Chinese characters.
_BLANK_OUTSIDE_ASCII = re.compile(r"(?<![!-~]) | (?![!-~])")
# Upstream turns every "." into "。"; a dot inside a token (test.com, e.g) is kept so that
# it is not read as a sentence end.
_SENTENCE_DOT = re.compile(r"(?<![A-Za-z0-9])\.|\.(?![A-Za-z0-9])")
_ZH_REMOVED = str.maketrans({"（": None, "）": None, "【": None, "】": None, "`": None})
_TRAILING_COMMAS = re.compile(r"[，,、]+$")
_DIGIT_RUN = re.compile(r"\d+")


def clean_input(text: str) -> str:
    """Normalize line breaks, drop invisible characters and map full-width digits to ASCII."""
    text = _LINE_BREAKS.sub("\n", text)
    text = _OTHER_BLANKS.sub(" ", text)
    text = _INVISIBLE.sub("", text)
    return text.translate(_FULLWIDTH_DIGITS)


def postprocess_zh(text: str) -> str:
    """Upstream's Chinese steps after wetext."""
    # Upstream deletes line breaks; a space instead keeps English words on two lines
    # apart, and the next step drops it anywhere else.
    text = _LINE_RUN.sub(" ", text)
    text = _BLANK_OUTSIDE_ASCII.sub("", text)
    text = text.replace("²", "平方").replace("³", "立方")
    text = _SENTENCE_DOT.sub("。", text)
    text = text.replace(" - ", "，")
    text = text.translate(_ZH_REMOVED).replace("——", " ")
    return _TRAILING_COMMAS.sub("。", text)


def postprocess_en(text: str, cardinal: EnCardinal) -> str:
    """Upstream's English step after wetext: spell out any digits wetext left."""
    # wetext turns a line break into a space (upstream relies on that); lines reach it
    # one by one here, so the breaks between them are joined the same way.
    text = _LINE_RUN.sub(" ", text)
    return _DIGIT_RUN.sub(lambda match: _spell_number(match.group(), cardinal), text)


def _spell_number(digits: str, cardinal: EnCardinal) -> str:
    # A leading zero marks a code, not an amount ("007"): read it digit by digit.
    if len(digits) > 1 and digits.startswith("0"):
        return en_digits(digits)
    return cardinal(int(digits))
