"""Table-driven rewrites that run before wetext, where wetext reads a pattern wrongly.

Each :class:`Fix` rewrites one pattern either into words (digit strings, money in
English) or into a form that wetext reads correctly (``￥128.50元`` -> ``128.5元``). The
tables for each language live in ``text_fixes_zh`` and ``text_fixes_en``; every entry
names the wetext 0.1.8 behaviour it corrects.
"""

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

# Reads a non-negative integer as English words ("one thousand two hundred"); the
# normalizer passes its inflect-backed reader so that the tables stay pure data.
EnCardinal = Callable[[int], str]
Rewrite = Callable[[re.Match[str], EnCardinal], str]


@dataclass(frozen=True, slots=True)
class Fix:
    """One rewrite rule: every match of ``pattern`` is replaced by ``rewrite(match, cardinal)``."""

    name: str
    pattern: re.Pattern[str]
    rewrite: Rewrite


def apply_fixes(text: str, fixes: tuple[Fix, ...], cardinal: EnCardinal) -> str:
    """Apply the rules in table order; later rules see the output of earlier ones."""
    for fix in fixes:
        text = fix.pattern.sub(partial(_call, fix.rewrite, cardinal), text)
    return text


def _call(rewrite: Rewrite, cardinal: EnCardinal, match: re.Match[str]) -> str:
    return rewrite(match, cardinal)


# Shared pattern pieces. A number is "standalone" when it is not glued to other digits,
# decimal points or date/time separators, so that parts of dates, times and decimals are
# never rewritten on their own.
NOT_AFTER_NUMBER_PART = r"(?<![\d.:/\-+])"
NOT_BEFORE_NUMBER_PART = r"(?![\d\-:/]|\.\d)"

PHONE_INTL_RE = re.compile(r"(?<![\w+])\+\d{1,3}(?:(?:[ \-]\d{1,5}){1,5}|\d{6,12})" + NOT_BEFORE_NUMBER_PART)
PHONE_LOCAL_RE = re.compile(
    NOT_AFTER_NUMBER_PART
    + r"(?:\(\d{3}\)\s?\d{3}-\d{4}|\d{3}-\d{3}-\d{4}|\d{3,4}-\d{7,8}|\d{3}-\d{4})"
    + NOT_BEFORE_NUMBER_PART
)
LONG_DIGITS_RE = re.compile(r"(?<![\d.])\d{10,}(?!\d|\.\d)")
LEADING_ZERO_RE = re.compile(NOT_AFTER_NUMBER_PART + r"0\d{2,}" + NOT_BEFORE_NUMBER_PART)
# 1.2.3, but not dotted dates such as 2024.03.05 (wetext reads those as dates) nor IP
# addresses (four groups, which wetext reads digit by digit with "dot").
VERSION_RE = re.compile(r"(?<![\d.])(?!(?:19|20)\d\d\.[01]?\d\.[0-3]?\d(?![\d.]))\d+\.\d+\.\d+(?!\d|\.\d)")
DECADE_RE = re.compile(r"(?<![\d'’])(?P<century>1\d|20)(?P<decade>\d)0s(?![A-Za-z])")


def digit_groups(text: str) -> list[str]:
    """The digit runs of a phone number, in order: ``"(555) 123-4567"`` -> ``["555", "123", "4567"]``."""
    return re.findall(r"\d+", text)
