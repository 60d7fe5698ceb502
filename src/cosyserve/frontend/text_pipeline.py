"""The text frontend as synthesis uses it: normalize, split, drop unspeakable segments."""

from cosyserve.errors import InvalidRequestError
from cosyserve.frontend.sentence_splitter import SplitOptions, TokenCount
from cosyserve.frontend.text_normalizer import TextNormalizer

# Stable: clients and tests match on it.
NOTHING_TO_SPEAK = "text is empty or has nothing to speak after normalization"


def normalize_and_split(
    text: str,
    token_count: TokenCount | None = None,
    *,
    normalizer: TextNormalizer | None = None,
    options: SplitOptions | None = None,
    raise_if_empty: bool = False,
) -> list[str]:
    """Normalized synthesis segments of ``text``, in order (see ``TextNormalizer.normalize_and_split``).

    Returns ``[]`` when nothing speakable is left (empty text, only punctuation or emoji);
    with ``raise_if_empty`` it raises :class:`InvalidRequestError` with the message
    :data:`NOTHING_TO_SPEAK` instead. Pass a shared ``normalizer``: a fresh one per call
    works, but repeats the lazy loading.
    """
    segments = (normalizer or TextNormalizer()).normalize_and_split(text, token_count, options)
    if not segments and raise_if_empty:
        raise InvalidRequestError(NOTHING_TO_SPEAK)
    return segments
