"""Special tokens and markup that text processing must pass through untouched.

The CosyVoice 2 tokenizer adds these strings as single tokens (spec section 3.2); the
LLM reads them as events or emphasis, so normalization must not spell, split or remove
them. ``<|...|>`` tags that are not in the list (language tags such as ``<|en|>``, which
CosyVoice 2 tokenizes as plain text but which prompts still carry) are kept too.
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

# Longest first, so that no token is matched as a prefix of a longer one.
_TOKEN_ALTERNATIVES = "|".join(re.escape(t) for t in sorted(SPECIAL_TOKENS, key=len, reverse=True))
_ANGLE_TAG = r"<\|[^<>|\s]{1,32}\|>"
SPECIAL_TOKEN_RE = re.compile(f"{_TOKEN_ALTERNATIVES}|{_ANGLE_TAG}")


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
