"""Number words that our own fixes produce (wetext produces the rest).

Digit-by-digit readings use 幺 for 1 in Chinese, as wetext itself does for mobile numbers,
so that every phone number and code in one text sounds the same; English uses "zero"
(not "oh"), which no listener mistakes for a letter.
"""

_ZH_DIGITS = "零幺二三四五六七八九"
_ZH_CARDINAL_DIGITS = "零一二三四五六七八九"
_EN_DIGITS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
_ZH_SMALL_UNITS = ("", "十", "百", "千")
_ZH_MAX_CARDINAL = 10**8  # 亿 and above never come from our fixes; larger numbers are read digit by digit


def zh_digits(digits: str) -> str:
    """Read an ASCII digit string digit by digit: ``"0101"`` -> ``"零幺零幺"``."""
    return "".join(_ZH_DIGITS[int(d)] for d in digits)


def zh_year(digits: str) -> str:
    """Read a year digit by digit with 一 (years never use 幺): ``"1990"`` -> ``"一九九零"``."""
    return "".join(_ZH_CARDINAL_DIGITS[int(d)] for d in digits)


def en_digits(digits: str) -> str:
    """Read an ASCII digit string digit by digit: ``"5551"`` -> ``"five five five one"``."""
    return " ".join(_EN_DIGITS[int(d)] for d in digits)


def _zh_below_10000(n: int) -> str:
    """Read 1 <= n < 10000 with 零 for inner gaps (一千零一, 一百一十)."""
    out: list[str] = []
    pending_zero = False
    for power in (3, 2, 1, 0):
        digit = n // 10**power % 10
        if digit == 0:
            pending_zero = bool(out)
            continue
        if pending_zero:
            out.append("零")
            pending_zero = False
        out.append(_ZH_CARDINAL_DIGITS[digit] + _ZH_SMALL_UNITS[power])
    return "".join(out)


def zh_cardinal(n: int) -> str:
    """Read a non-negative integer as a Chinese cardinal: 12 -> 十二, 10086 -> 一万零八十六."""
    if n < 0:
        raise ValueError("zh_cardinal reads non-negative integers only")
    if n == 0:
        return "零"
    if n >= _ZH_MAX_CARDINAL:
        return zh_digits(str(n))
    high, low = divmod(n, 10_000)
    if high == 0:
        text = _zh_below_10000(low)
    else:
        text = _zh_below_10000(high) + "万"
        if low:
            text += ("零" if low < 1000 else "") + _zh_below_10000(low)
    # 十二, not 一十二: a leading 一十 is only said inside larger numbers.
    return text[1:] if text.startswith("一十") else text


def trim_decimal(number: str) -> str:
    """Drop trailing zeros of a decimal: ``"128.50"`` -> ``"128.5"``, ``"12.00"`` -> ``"12"``."""
    if "." not in number:
        return number
    return number.rstrip("0").rstrip(".")
