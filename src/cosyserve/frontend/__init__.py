"""Text frontend: normalization (wetext plus our fixes) and lossless sentence splitting."""

from cosyserve.frontend.sentence_splitter import (
    Language,
    SplitOptions,
    TokenCount,
    approx_token_count,
    cut_sentences,
    is_speakable,
    speakable_segments,
    split_sentences,
)
from cosyserve.frontend.text_normalizer import TextNormalizer
from cosyserve.frontend.text_pipeline import NOTHING_TO_SPEAK, normalize_and_split
from cosyserve.frontend.text_tokens import SPECIAL_TOKENS

__all__ = [
    "NOTHING_TO_SPEAK",
    "SPECIAL_TOKENS",
    "Language",
    "SplitOptions",
    "TextNormalizer",
    "TokenCount",
    "approx_token_count",
    "cut_sentences",
    "is_speakable",
    "normalize_and_split",
    "speakable_segments",
    "split_sentences",
]
