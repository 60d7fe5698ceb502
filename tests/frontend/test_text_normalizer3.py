"""CosyVoice 3 text through the normalizer: its inline pronunciation tokens (``[h][ǎo]``,
``[HH][AH0]``) and ``<|endofsystem|>`` pass through unchanged, like CosyVoice 2's tokens.

Upstream's ``text_normalize`` (wetext path) keeps the pinyin tokens but spells the CMU
stress digits (``[AH0]`` -> ``[AHzero]`` in English, ``[AH零]`` in Chinese), which are
then no longer tokens; it leaves text with ``<|`` and ``|>`` entirely alone.
"""

import re

import pytest

from cosyserve.frontend.sentence_splitter import SplitOptions
from cosyserve.frontend.text_normalizer import TextNormalizer
from cosyserve.frontend.text_pack import fit
from cosyserve.frontend.text_tokens import COSYVOICE3_EXTRA_TOKENS, COSYVOICE3_SPECIAL_TOKENS


@pytest.fixture(scope="module")
def normalizer() -> TextNormalizer:
    return TextNormalizer(COSYVOICE3_SPECIAL_TOKENS)


@pytest.mark.parametrize("token", COSYVOICE3_EXTRA_TOKENS)
def test_every_cosyvoice3_token_survives_next_to_numbers(normalizer: TextNormalizer, token: str) -> None:
    assert normalizer.normalize(f"今天{token}3点，价格{token}") == f"今天{token}三点，价格{token}"
    assert normalizer.normalize(f"I have {token}3 cats{token}.") == f"I have {token}three cats{token}."


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # upstream's CosyVoice 3 example
        (
            "高管也通过电话、短信、微信等方式对报道[j][ǐ]予好评。",
            "高管也通过电话、短信、微信等方式对报道[j][ǐ]予好评。",
        ),
        ("你[h][ǎo]，今天[t][iān]气很好3点。", "你[h][ǎo]，今天[t][iān]气很好三点。"),
        ("Say [HH][AH0][L][OW1] to the world 2 times.", "Say [HH][AH0][L][OW1] to the world two times."),
        ("The word [R][EH1][K][ER0][D] has 2 syllables.", "The word [R][EH1][K][ER0][D] has two syllables."),
        ("今天[AH0]3点[AA2]", "今天[AH0]三点[AA2]"),
        ("[breath]因为他们那一辈人[breath]在乡里面住的。", "[breath]因为他们那一辈人[breath]在乡里面住的。"),
        ("system<|endofsystem|>Hello 42.", "system<|endofsystem|>Hello forty two."),
    ],
)
def test_cosyvoice3_texts(normalizer: TextNormalizer, text: str, expected: str) -> None:
    assert normalizer.normalize(text) == expected


def test_the_default_normalizer_is_cosyvoice2s(normalizer: TextNormalizer) -> None:
    # CosyVoice 2's tokenizer has no [AH0]: its digit is read like any other.
    assert TextNormalizer().normalize("Say [AH0].") == "Say [AHzero]."
    assert normalizer.normalize("Say [AH0].") == "Say [AH0]."


def test_splitting_never_cuts_a_pronunciation_token(normalizer: TextNormalizer) -> None:
    text = "我们" + "[zh][uāng][iǎng]" * 12 + "很好。" + "ab[HH][AH0]cd" * 10 + "。"
    options = SplitOptions(token_max_n=9, token_min_n=2, merge_len=1, hard_max_n=9)
    segments = normalizer.normalize_and_split(text, options=options)
    assert "".join(segments) == text
    token = re.compile(r"\[[^\[\]]*\]")
    for segment in segments:
        assert all(t in COSYVOICE3_SPECIAL_TOKENS for t in token.findall(segment)), segment
    # The last-resort cut (no separator at all) keeps the tokens whole too.
    pieces = fit("[iǎng][uāng][AH0]" * 4, len, 7, ())
    assert all(piece in {"[iǎng]", "[uāng]", "[AH0]"} for piece in pieces)
