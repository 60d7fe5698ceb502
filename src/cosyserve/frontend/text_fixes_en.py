"""English rewrites before wetext (see ``text_fixes``); each comment names the wetext 0.1.8 bug.

Money is read as "three dollars and fifty cents": the "three point five dollars" that
wetext says is not how anyone reads a price, and a bare "three dollars fifty" becomes
unclear for amounts like $1,200.05. Yuan (¥, ￥) keeps the decimal reading, as in Chinese
(一百二十八点五元 -> "one hundred twenty eight point five yuan").
"""

import re

from cosyserve.frontend.text_fixes import (
    DECADE_RE,
    LEADING_ZERO_RE,
    LONG_DIGITS_RE,
    PHONE_INTL_RE,
    PHONE_LOCAL_RE,
    VERSION_RE,
    EnCardinal,
    Fix,
    Rewrite,
    digit_groups,
)
from cosyserve.frontend.text_numbers import en_digits, trim_decimal

# symbol -> (major singular, major plural, minor singular, minor plural); no minor unit
# means the amount is read with "point".
_CURRENCIES: dict[str, tuple[str, str, str | None, str | None]] = {
    "$": ("dollar", "dollars", "cent", "cents"),
    "€": ("euro", "euros", "cent", "cents"),
    "£": ("pound", "pounds", "penny", "pence"),
    "¥": ("yuan", "yuan", None, None),
    "￥": ("yuan", "yuan", None, None),
}
_DECADES = (
    "",
    "tens",
    "twenties",
    "thirties",
    "forties",
    "fifties",
    "sixties",
    "seventies",
    "eighties",
    "nineties",
)
_DIGIT_KEYWORDS = (
    "phone|telephone|tel|fax|call|dial|code|pin|zip|postcode|account|ext|extension|id|serial|tracking"
)


def _money(match: re.Match[str], cardinal: EnCardinal) -> str:
    major_one, major_many, minor_one, minor_many = _CURRENCIES[match["symbol"]]
    whole = int(match["whole"].replace(",", ""))
    fraction = match["fraction"] or ""
    if minor_one is None or minor_many is None:
        decimals = trim_decimal(f"0.{fraction}")[2:] if fraction else ""
        point = f" point {en_digits(decimals)}" if decimals else ""
        return f"{cardinal(whole)}{point} {major_many}"
    minor = int(fraction.ljust(2, "0")) if fraction else 0
    parts: list[str] = []
    if whole or not minor:
        parts.append(f"{cardinal(whole)} {major_one if whole == 1 else major_many}")
    if minor:
        parts.append(f"{cardinal(minor)} {minor_one if minor == 1 else minor_many}")
    return " and ".join(parts)


def _grouped_number(match: re.Match[str], cardinal: EnCardinal) -> str:
    words = cardinal(int(match["whole"].replace(",", "")))
    return f"{words} point {en_digits(match['fraction'])}" if match["fraction"] else words


def _phone_intl(match: re.Match[str], _: EnCardinal) -> str:
    return "plus " + en_digits("".join(digit_groups(match.group())))


def _digits(match: re.Match[str], _: EnCardinal) -> str:
    return en_digits("".join(digit_groups(match.group())))


def _keyword_digits(match: re.Match[str], _: EnCardinal) -> str:
    return match["keyword"] + match["sep"] + en_digits(match["number"])


def _version(match: re.Match[str], cardinal: EnCardinal) -> str:
    return " point ".join(cardinal(int(group)) for group in match.group().split("."))


def _decade(match: re.Match[str], cardinal: EnCardinal) -> str:
    century, decade = int(match["century"]), int(match["decade"])
    if decade:
        return f"{cardinal(century)} {_DECADES[decade]}"
    return "two thousands" if century == 20 else f"{cardinal(century)} hundreds"


def _space_before_number(_match: re.Match[str], _cardinal: EnCardinal) -> str:
    return " "


def _to(_match: re.Match[str], _cardinal: EnCardinal) -> str:
    return " to "


def _words(words: str) -> Rewrite:
    def rewrite(_match: re.Match[str], _cardinal: EnCardinal) -> str:
        return words

    return rewrite


EN_FIXES: tuple[Fix, ...] = (
    # $1,200.05 -> "thousand two hundred point oh five dollars" (the "one" is lost);
    # $3.50 -> "three point five dollars". Amounts with a scale word ($1.5 million) are
    # left to wetext, which reads them well.
    Fix(
        "money",
        re.compile(
            r"(?P<symbol>[$€£¥￥])\s?(?P<whole>\d{1,3}(?:,\d{3})+|\d+)(?:\.(?P<fraction>\d{1,2}))?"
            r"(?!\d|[.,]\d|\s?(?:[mMbB]illion|[tT]housand|[tT]rillion|bn|[KMB])\b)"
        ),
        _money,
    ),
    # 1,234 -> "thousand two hundred and thirty four" (the "one" is lost). Without the
    # commas wetext would read 1234 as a year, so the whole number is spelled here.
    Fix(
        "thousands_separator",
        re.compile(r"(?<![\d.,])(?P<whole>\d{1,3}(?:,\d{3})+)(?:\.(?P<fraction>\d+))?(?!\d|\.\d)"),
        _grouped_number,
    ),
    # +1 555 123 4567 -> AssertionError inside wetext.
    Fix("phone_international", PHONE_INTL_RE, _phone_intl),
    # 555-1234 -> "five hundred and fifty five to one thousand two hundred and thirty four".
    Fix("phone_local", PHONE_LOCAL_RE, _digits),
    # "PIN 0420", "code 123456" -> read as amounts.
    Fix(
        "keyword_digits",
        re.compile(
            rf"\b(?P<keyword>{_DIGIT_KEYWORDS})(?P<sep>\.?\s?(?:number|no\.?|#)?\s?(?:is|:|#)?\s?)"
            r"(?P<number>\d{3,})(?!\d|[.,]\d)",
            re.IGNORECASE,
        ),
        _keyword_digits,
    ),
    # 1234567890 -> "one billion two hundred thirty four million …".
    Fix("long_digits", LONG_DIGITS_RE, _digits),
    # 0123 -> "oh one hundred and twenty three".
    Fix("leading_zero", LEADING_ZERO_RE, _digits),
    # version 1.2.3 -> "version one.two point three".
    Fix("version", VERSION_RE, _version),
    # 20%-30% -> "twenty-thirty percent", 5~10 -> "five tilde ten".
    Fix("range", re.compile(r"(?<=\d%)-(?=\d)|(?<=[\d%])\s?[~～]\s?(?=\d)"), _to),
    # 24/7 -> "twenty four sevenths".
    Fix("around_the_clock", re.compile(r"(?<![\d/])24/7(?![\d/])"), _words("twenty four seven")),
    # #1 -> AssertionError inside wetext.
    Fix("number_sign", re.compile(r"(?<![\w#&])#(?=\d)"), _words("number ")),
    # Qwen2.5 -> "Qwen two.five": with a space wetext reads the decimal.
    Fix("letter_decimal", re.compile(r"(?<=[A-Za-z])(?=\d+\.\d)"), _space_before_number),
    # the 1990s -> "the one thousand nine hundred and ninety seconds".
    Fix("decade", DECADE_RE, _decade),
)
