"""Unit tests of the normalizer around wetext: protection, fallbacks, chunking, threads."""

import logging
import re
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cosyserve.frontend import SPECIAL_TOKENS, TextNormalizer
from cosyserve.frontend.text_cleanup import clean_input, postprocess_en, postprocess_zh
from cosyserve.frontend.text_fixes_en import EN_FIXES
from cosyserve.frontend.text_fixes_zh import ZH_FIXES
from cosyserve.frontend.text_numbers import en_digits, trim_decimal, zh_cardinal, zh_digits
from cosyserve.frontend.text_tokens import split_protected
from tests.upstream import upstream


@pytest.fixture(scope="module")
def normalizer() -> TextNormalizer:
    return TextNormalizer()


@pytest.mark.parametrize(
    ("text", "language"),
    [("hello", "en"), ("你好", "zh"), ("Hello 世界", "zh"), ("こんにちは", "en"), ("", "en"), ("123", "en")],
)
def test_language_is_zh_when_any_cjk_ideograph_is_present(
    normalizer: TextNormalizer, text: str, language: str
) -> None:
    assert normalizer.language(text) == language


@pytest.mark.parametrize("text", ["", "   ", "\n\t", "\u200b\ufeff"])
def test_text_with_nothing_in_it_normalizes_to_empty(normalizer: TextNormalizer, text: str) -> None:
    assert normalizer.normalize(text) == ""


@pytest.mark.parametrize("token", SPECIAL_TOKENS)
def test_every_special_token_survives_next_to_numbers(normalizer: TextNormalizer, token: str) -> None:
    assert normalizer.normalize(f"今天{token}3点，价格{token}") == f"今天{token}三点，价格{token}"
    assert normalizer.normalize(f"I have {token}3 cats{token}.") == f"I have {token}three cats{token}."


@pytest.mark.parametrize("token", SPECIAL_TOKENS)
def test_post_processing_never_changes_a_special_token(token: str) -> None:
    # normalize() runs the post-processing over the joined text, tokens included.
    assert postprocess_zh(token) == token
    assert postprocess_en(token, str) == token
    assert split_protected(token)[0].protected


def test_special_token_list_is_the_cosyvoice2_tokenizer_list() -> None:
    assert len(SPECIAL_TOKENS) == 20
    assert SPECIAL_TOKENS[3:6] == ("<|endofprompt|>", "[breath]", "<strong>")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("a\\b costs 1", "a\\b costs one"),  # wetext returns a\\b
        ('路径C:\\data里有3个"文件"', '路径C:\\data里有三个"文件"'),
        ("Results: {x} and 5 more", "Results: {x} and five more"),  # wetext raises on braces
    ],
)
def test_characters_wetext_escapes_pass_through(normalizer: TextNormalizer, text: str, expected: str) -> None:
    assert normalizer.normalize(text) == expected


def test_wetext_failure_degrades_word_by_word_without_logging_the_text(
    normalizer: TextNormalizer, caplog: pytest.LogCaptureFixture
) -> None:
    secret = "5$ is the price of 3 apples"  # "5$" makes wetext's English grammar raise
    with caplog.at_level(logging.WARNING):
        assert normalizer.normalize(secret) == "five$ is the price of three apples"
    assert "wetext failed" in caplog.text
    assert "apples" not in caplog.text


def test_line_breaks_and_tabs(normalizer: TextNormalizer) -> None:
    # wetext's English grammar raises on blank lines and tabs; lines join with a space.
    assert normalizer.normalize("line one\n\nline 2\tend") == "line one line two end"
    assert normalizer.normalize("第一行有3个\n第二行\r\nEnglish\nwords") == "第一行有三个第二行English words"


def test_long_text_reaches_wetext_in_bounded_chunks(normalizer: TextNormalizer) -> None:
    seen: list[int] = []
    run_wetext = normalizer._run_wetext

    def spy(text: str, language: str) -> str:
        seen.append(len(text))
        return run_wetext(text, language)  # type: ignore[arg-type]

    text = "今天是2024年3月5日，价格128元" * 400 + "。"  # no sentence end for 8,000 characters
    normalizer._run_wetext = spy  # type: ignore[method-assign]
    try:
        spoken = normalizer.normalize(text)
    finally:
        del normalizer._run_wetext
    assert max(seen) <= 200
    assert not re.search(r"\d", spoken)
    assert spoken.count("二零二四年三月五日") == 400


def test_shared_instance_gives_the_same_results_from_many_threads() -> None:
    shared = TextNormalizer()
    texts = [
        "价格￥128.50元",
        "$3.50 and 1,234 apples",
        "电话555-1234",
        "On 2024-03-05.",
        "共1,234,567人",
    ] * 4
    expected = [TextNormalizer().normalize(text) for text in texts]
    results: dict[int, list[str]] = {}

    def work(worker: int) -> None:
        results[worker] = [shared.normalize(text) for text in texts]

    threads = [threading.Thread(target=work, args=(worker,)) for worker in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(results[worker] == expected for worker in range(4))


def test_warmup_loads_both_languages() -> None:
    fresh = TextNormalizer()
    fresh.warmup()
    assert fresh.normalize("3个") == "三个"
    assert fresh.normalize("3 cats") == "three cats"


def test_clean_input() -> None:
    assert clean_input("a\r\nb\rc\td\u200be\ufeff\x00f１２") == "a\nb\nc de" + "f12"


@pytest.mark.parametrize(
    ("number", "words"),
    [
        (0, "零"),
        (7, "七"),
        (10, "十"),
        (12, "十二"),
        (20, "二十"),
        (101, "一百零一"),
        (110, "一百一十"),
        (1001, "一千零一"),
        (1010, "一千零一十"),
        (10000, "一万"),
        (10086, "一万零八十六"),
        (110000, "十一万"),
        (1000001, "一百万零一"),
        (10010000, "一千零一万"),
        (99999999, "九千九百九十九万九千九百九十九"),
        (123456789, "幺二三四五六七八九"),
    ],
)
def test_zh_cardinal(number: int, words: str) -> None:
    assert zh_cardinal(number) == words


def test_digit_readings_and_decimal_trimming() -> None:
    assert zh_digits("0123456789") == "零幺二三四五六七八九"
    assert en_digits("505") == "five zero five"
    assert [trim_decimal(n) for n in ("128.50", "12.00", "0.50", "3", "10.05")] == [
        "128.5",
        "12",
        "0.5",
        "3",
        "10.05",
    ]


def test_fix_tables_have_unique_names() -> None:
    for table in (ZH_FIXES, EN_FIXES):
        names = [fix.name for fix in table]
        assert len(names) == len(set(names))


_ZH_POST_ALPHABET = st.sampled_from(list("你好世界ab1 ²³（）【】`—,，、-"))


@settings(max_examples=200, deadline=None)
@given(st.text(_ZH_POST_ALPHABET, min_size=1).map(str.strip).filter(bool))
def test_zh_post_processing_matches_upstream(text: str) -> None:
    # Upstream's chain (cosyvoice/cli/frontend.py) minus the "." step and the line
    # breaks, where we differ on purpose.
    utils = upstream("cosyvoice.utils.frontend_utils")
    expected = utils.replace_blank(text)
    expected = utils.replace_corner_mark(expected).replace(" - ", "，")
    expected = re.sub(r"[，,、]+$", "。", utils.remove_bracket(expected))
    assert postprocess_zh(text) == expected
