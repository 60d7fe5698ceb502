"""The pronunciation dictionary's file format and its CosyVoice 3 token forms."""

from pathlib import Path

import pytest

from cosyserve.frontend.pronunciation import (
    PronunciationError,
    Pronunciations,
    read_text,
    to_cosyvoice3_tokens,
)


@pytest.mark.parametrize(
    ("spoken", "tokens"),
    [
        ("hang2", "[h][áng]"),  # 行 in 银行
        ("xing2", "[x][íng]"),  # 行 in 行走
        ("chong2 qing4", "[ch][óng][q][ìng]"),  # 重 in 重庆
        ("zhong4", "[zh][òng]"),
        ("zhang3", "[zh][ǎng]"),  # 长 in 长大
        ("chang2", "[ch][áng]"),
        ("huan2", "[h][uán]"),  # 还 in 还钱
        ("hai2", "[h][ái]"),
        ("ju3", "[j][ǔ]"),  # ü written u after j, q, x, y
        ("lv4", "[l][ǜ]"),
        ("lü4", "[l][ǜ]"),
        ("nve4", "[n][vè]"),
        ("liu2 shui3", "[l][iú][sh][uǐ]"),  # the mark on the last vowel of iu, ui
        ("gou3", "[g][ǒu]"),
        ("er2", "[ér]"),
        ("de5", "[d][e]"),
        ("de", "[d][e]"),
        ("HH AH0 L OW1", "[HH][AH0][L][OW1]"),
        ("[j][ǐ]", "[j][ǐ]"),
    ],
)
def test_pronunciations_become_cosyvoice3_tokens(spoken: str, tokens: str) -> None:
    assert to_cosyvoice3_tokens(spoken) == tokens


@pytest.mark.parametrize(
    ("spoken", "message"),
    [
        ("hang6", "neither a pinyin syllable"),
        ("hello", "is not a CosyVoice 3 pronunciation token"),
        ("[h][xyz]", r"\[xyz\] is not a CosyVoice 3"),
        ("[h] ang", "mixes tokens with other text"),
        ("AA7", "neither a pinyin syllable"),
    ],
)
def test_what_cosyvoice3_cannot_speak_is_refused(spoken: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        to_cosyvoice3_tokens(spoken)


def test_file_format_comments_and_errors_name_the_line(tmp_path: Path) -> None:
    text = "# polyphones\n银行 yin2 hang2\n\n重庆\tchong2 qing4  # the city\n"
    assert Pronunciations.parse(text, cosyvoice3=True).entries == {
        "银行": "[y][ín][h][áng]",
        "重庆": "[ch][óng][q][ìng]",
    }
    assert Pronunciations.parse(text, cosyvoice3=False).entries["重庆"] == "chong2 qing4"
    with pytest.raises(PronunciationError, match=r"dict.txt:2: expected a word and its pronunciation"):
        Pronunciations.parse("银行 hang2\n长大\n", cosyvoice3=True, source="dict.txt")
    with pytest.raises(PronunciationError, match=r"p:1: 长大: 'zhang9' is neither"):
        Pronunciations.parse("长大 zhang9 da4\n", cosyvoice3=True, source="p")
    with pytest.raises(PronunciationError, match="not readable"):
        read_text(tmp_path / "missing.txt")


def test_longest_word_first_and_never_twice() -> None:
    words = Pronunciations({"银行": "[y][ín][h][áng]", "行长": "[h][áng][zh][ǎng]", "行": "[x][íng]"})
    # 银行 wins at its position; the 行 of 行长 is then not re-read inside the replacement.
    assert words.apply("银行行长行") == "[y][ín][h][áng][h][áng][zh][ǎng][x][íng]"
    assert Pronunciations.empty().apply("银行") == "银行"
