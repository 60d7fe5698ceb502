"""The ``pronunciations`` setting: one dictionary file, read into each served model's form.

CosyVoice 3 reads a pronunciation as its pinyin and phoneme tokens, CosyVoice 2 as
replacement text (:mod:`cosyserve.frontend.pronunciation`), so the file is parsed once per
family. Either every model gets the new dictionary or none does.
"""

import logging
from collections.abc import Sequence
from pathlib import Path

from cosyserve.frontend.pronunciation import Pronunciations, read_text
from cosyserve.modeldir.family import Family
from cosyserve.server.service import SpeechService

logger = logging.getLogger(__name__)


class PronunciationFile:
    """``path`` (empty: no dictionary), applied to services' frontends."""

    def __init__(self, path: str) -> None:
        self.path = Path(path) if path else None

    def apply(self, services: Sequence[SpeechService]) -> None:
        """Read the file and give each service its family's dictionary; raises
        :class:`~cosyserve.frontend.pronunciation.PronunciationError` and changes nothing
        when the file cannot be read or has an entry a served model cannot speak."""
        if self.path is None:
            return
        text = read_text(self.path)  # once, for every family's parse
        parsed: dict[Family, Pronunciations] = {}
        for service in services:
            family = service.model.model_dir.family
            if family not in parsed:
                parsed[family] = Pronunciations.parse(text, family is Family.COSYVOICE3, str(self.path))
        for service in services:
            service.frontend.pronunciations = parsed[service.model.model_dir.family]
        sizes = ", ".join(f"{family}: {len(words.entries)}" for family, words in parsed.items())
        logger.info("pronunciations from %s (%s words)", self.path, sizes)
