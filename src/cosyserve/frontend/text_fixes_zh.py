"""Chinese rewrites before wetext (see ``text_fixes``); each comment names the wetext 0.1.8 bug."""

import re

from cosyserve.frontend.text_fixes import (
    DECADE_RE,
    LEADING_ZERO_RE,
    LONG_DIGITS_RE,
    NOT_AFTER_NUMBER_PART,
    NOT_BEFORE_NUMBER_PART,
    PHONE_INTL_RE,
    PHONE_LOCAL_RE,
    VERSION_RE,
    EnCardinal,
    Fix,
    Rewrite,
    digit_groups,
)
from cosyserve.frontend.text_numbers import trim_decimal, zh_cardinal, zh_digits, zh_year

_CURRENCY_WORDS = "元|块钱|块|美元|美金|欧元|英镑|日元|港元|港币|人民币"
_SYMBOL_WORDS = {"¥": "元", "￥": "元", "$": "美元", "€": "欧元", "£": "英镑"}
_DIGIT_KEYWORDS = (
    "电话号码|手机号码|手机号|电话|手机|号码|验证码|邮政编码|邮编|订单号|单号|编号|卡号|账号|帐号"
    "|工号|学号|房间号|房号|密码|尾号|微信号|QQ号|QQ"
)


def _drop_commas(match: re.Match[str], _: EnCardinal) -> str:
    return match.group().replace(",", "")


def _currency_symbol(match: re.Match[str], _: EnCardinal) -> str:
    word = (match["word"] or "").strip() or _SYMBOL_WORDS[match["symbol"]]
    return trim_decimal(match["number"]) + (match["scale"] or "").strip() + word


def _trim_money(match: re.Match[str], _: EnCardinal) -> str:
    return trim_decimal(match.group())


def _phone_intl(match: re.Match[str], _: EnCardinal) -> str:
    return "加" + zh_digits("".join(digit_groups(match.group())))


def _digits(match: re.Match[str], _: EnCardinal) -> str:
    return zh_digits("".join(digit_groups(match.group())))


def _keyword_digits(match: re.Match[str], _: EnCardinal) -> str:
    return match["keyword"] + match["sep"] + zh_digits(match["number"])


def _version(match: re.Match[str], _: EnCardinal) -> str:
    return "点".join(zh_cardinal(int(group)) for group in match.group().split("."))


def _decade(match: re.Match[str], _: EnCardinal) -> str:
    return zh_year(match["century"] + match["decade"] + "0") + "年代"


def _replace_with(text: str) -> Rewrite:
    def rewrite(_match: re.Match[str], _cardinal: EnCardinal) -> str:
        return text

    return rewrite


def _range(match: re.Match[str], _: EnCardinal) -> str:
    return match["low"] + "到" + match["high"]


ZH_FIXES: tuple[Fix, ...] = (
    # 1,234,567 -> 一,两百三十四,五百六十七 (each group read alone, commas left in).
    Fix("thousands_separator", re.compile(r"(?<![\d.,])\d{1,3}(?:,\d{3})+(?!\d)"), _drop_commas),
    # ￥128.50元 -> 一元二十八点五零元 (the symbol eats the first digit, currency said twice);
    # ¥1,200.05 -> 一元,两百点零五. The symbol becomes a currency word after the number.
    Fix(
        "currency_symbol",
        re.compile(
            r"(?P<symbol>[¥￥$€£])\s?(?P<number>\d+(?:\.\d+)?)(?P<scale>\s?[万亿])?"
            rf"(?P<word>\s?(?:{_CURRENCY_WORDS}))?"
        ),
        _currency_symbol,
    ),
    # 128.50元 -> 一百二十八点五零元: money is said without trailing zeros.
    Fix(
        "money_trailing_zeros",
        re.compile(rf"(?<![\d.])\d+\.\d+(?=\s?[万亿]?\s?(?:{_CURRENCY_WORDS}))"),
        _trim_money,
    ),
    # +86 138 1234 5678 -> 正八十六 一百三十八 …; +86-138-… -> …减一百三十八….
    Fix("phone_international", PHONE_INTL_RE, _phone_intl),
    # 555-1234 -> 五百五十五减一千二百三十四; 010-12345678 -> 零一零一二三… (一, not 幺).
    Fix("phone_local", PHONE_LOCAL_RE, _digits),
    # 验证码是123456 -> 十二万三千四百五十六: codes and numbers after these words are digits,
    # unless a unit shows that the number is an amount (手机1000元).
    Fix(
        "keyword_digits",
        re.compile(
            rf"(?P<keyword>{_DIGIT_KEYWORDS})(?P<sep>\s?(?:是|为|：|:)?\s?)(?P<number>\d{{3,}})"
            rf"(?!\d|\.\d|\s?(?:{_CURRENCY_WORDS}|[万亿个台部件人年%]))"
        ),
        _keyword_digits,
    ),
    # 123456789012 -> 一千二百三十四亿…; ID numbers come out as a mix of readings.
    Fix("long_digits", LONG_DIGITS_RE, _digits),
    # 0123 -> 零一百二十三.
    Fix("leading_zero", LEADING_ZERO_RE, _digits),
    # 3月05日 -> 三月零五日.
    Fix("date_leading_zero", re.compile(r"(?<!\d)0(?=\d\s?[月日号])"), _replace_with("")),
    # 1.2.3 -> 一.二点三 (and upstream then turns the "." into a sentence end).
    Fix("version", VERSION_RE, _version),
    # 1990s -> 一千九百九十秒.
    Fix("decade", DECADE_RE, _decade),
    # GPT-4 -> GPT负四, COVID-19 -> COVID负十九: a hyphen after a letter is not a minus.
    Fix("letter_hyphen", re.compile(r"(?<=[A-Za-z])-(?=\d)"), _replace_with(" ")),
    # 20%-30% -> 百分之二十百分之负三十 (the range is lost).
    Fix("percent_range", re.compile(r"(?<=\d%)-(?=\d)"), _replace_with("到")),
    # 100-200 -> 一百减两百 (wetext reads 5-10公里 as a range, but a bare pair as minus);
    # a following "=" keeps arithmetic (10-3=7) as subtraction.
    Fix(
        "number_range",
        re.compile(
            NOT_AFTER_NUMBER_PART
            + r"(?P<low>\d+(?:\.\d+)?)-(?P<high>\d+(?:\.\d+)?)"
            + NOT_BEFORE_NUMBER_PART
            + r"(?!\s?[=＝])"
        ),
        _range,
    ),
)
