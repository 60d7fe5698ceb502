"""Special tokens and markup that text processing must pass through untouched.

The CosyVoice 2 tokenizer adds these strings as single tokens (spec section 3.2); the
LLM reads them as events or emphasis, so normalization must not spell, split or remove
them. ``<|...|>`` tags that are not in the list (language tags such as ``<|en|>``, which
CosyVoice 2 tokenizes as plain text but which prompts still carry) are kept too.

The CosyVoice 3 tokenizer adds ``<|endofsystem|>`` and pronunciation tokens after them:
CMU (ARPAbet) phones such as ``[HH][AH0]`` and pinyin initials and toned finals such as
``[h][ǎo]``, written inline to fix how a word is read (:data:`COSYVOICE3_SPECIAL_TOKENS`).
"""

import re
from dataclasses import dataclass

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|endofprompt|>",
    "[breath]",
    "<strong>",
    "</strong>",
    "[noise]",
    "[laughter]",
    "[cough]",
    "[clucking]",
    "[accent]",
    "[quick_breath]",
    "<laughter>",
    "</laughter>",
    "[hissing]",
    "[sigh]",
    "[vocalized-noise]",
    "[lipsmack]",
    "[mn]",
)


def _words(text: str) -> list[str]:
    return text.split()


# CosyVoice 3's pronunciation tokens. ARPAbet vowels come bare and with stress 0, 1 and 2.
_CMU_VOWELS = _words("AA AE AH AO AW AY EH ER EY IH IY OW OY UH UW")
_CMU_CONSONANTS = _words("B CH D DH F G HH JH K L M N NG P R S SH T TH V W Y Z ZH")
# Pinyin initials and finals (toned finals in precomposed NFC form), as CosyVoice 3 lists them.
_PINYIN_UNITS = _words(
    """
    a ai an ang ao e ei en eng o ong ou i ian in ing iu u uang ue un uo vè
    b c ch d f g h j k l m n p q r s sh t w x y z zh
    à ài àn àng ào á ái án áng áo ā āi ān āng āo ǎ ǎi ǎn ǎng ǎo
    è èi èn èng èr é éi én éng ér ē ēi ēn ēng ě ěi ěn ěng ěr
    ì ìn ìng í ín íng ī īn īng ǐ ǐn ǐng ò òng òu ó óng óu ō ōng ōu ǒ ǒng ǒu
    ù ùn ú ún ū ūn ǔ ǔn ǘ ǚ ǜ
    ià iàn iàng iào iá ián iáng iáo iā iān iāng iāo iǎ iǎn iǎng iǎo
    iè ié iē iě iòng ióng iōng iǒng iù iú iū iǔ
    uà uài uàn uàng uá uái uán uáng uā uāi uān uāng uǎ uǎi uǎn uǎng
    uè ué uē uě uì uí uī uǐ uò uó uō uǒ
"""
)


def _cmu_tokens() -> tuple[str, ...]:
    """``[AA] [AA0] [AA1] [AA2] [AE] ... [ZH]``: phones in alphabetical order, vowels with stresses."""
    tokens: list[str] = []
    for phone in sorted(_CMU_VOWELS + _CMU_CONSONANTS):
        stresses = ("", "0", "1", "2") if phone in _CMU_VOWELS else ("",)
        tokens += [f"[{phone}{stress}]" for stress in stresses]
    return tuple(tokens)


# After CosyVoice 2's tokens, in this order (so ids 151663 ... 151923): <|endofsystem|>,
# the 84 CMU tokens, then the 176 pinyin tokens in code point order.
COSYVOICE3_EXTRA_TOKENS: tuple[str, ...] = (
    "<|endofsystem|>",
    *_cmu_tokens(),
    *sorted(f"[{unit}]" for unit in _PINYIN_UNITS),
)
COSYVOICE3_SPECIAL_TOKENS: tuple[str, ...] = SPECIAL_TOKENS + COSYVOICE3_EXTRA_TOKENS


def special_token_re(tokens: tuple[str, ...]) -> re.Pattern[str]:
    """A pattern matching any of ``tokens`` and any ``<|...|>`` tag, longest token first so
    that none is matched as a prefix of a longer one."""
    alternatives = "|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True))
    return re.compile(f"{alternatives}|{_ANGLE_TAG}")


_ANGLE_TAG = r"<\|[^<>|\s]{1,32}\|>"
SPECIAL_TOKEN_RE = special_token_re(SPECIAL_TOKENS)
COSYVOICE3_SPECIAL_TOKEN_RE = special_token_re(COSYVOICE3_SPECIAL_TOKENS)


@dataclass(frozen=True, slots=True)
class Span:
    """A piece of text; ``protected`` pieces must reach the output unchanged."""

    text: str
    protected: bool


def split_protected(text: str, protected: re.Pattern[str] = SPECIAL_TOKEN_RE) -> list[Span]:
    """Cut ``text`` into alternating plain and protected spans; their texts join to ``text``."""
    spans: list[Span] = []
    start = 0
    for match in protected.finditer(text):
        if match.start() > start:
            spans.append(Span(text[start : match.start()], protected=False))
        spans.append(Span(match.group(), protected=True))
        start = match.end()
    if start < len(text):
        spans.append(Span(text[start:], protected=False))
    return spans
