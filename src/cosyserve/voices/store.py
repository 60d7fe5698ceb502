"""What every voice store offers: :class:`VoiceStore`, its errors and :class:`VoiceInfo`.

Two stores implement it: :class:`~cosyserve.voices.sqlite.SqliteVoiceStore` (one file,
the default for one machine) and :class:`~cosyserve.voices.postgres.PostgresVoiceStore`
(one database that every replica shares). :func:`~cosyserve.voices.factory.open_voice_store`
picks one from the ``voices_db`` setting. Both keep the same columns
(:data:`cosyserve.voices.rows.COLUMNS`) and the same ``.npy`` feature encoding.
"""

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from types import TracebackType
from typing import Self

from cosyserve.errors import CosyserveError
from cosyserve.pipeline.voice import VoicePrompt

# Bump when the frontend's prompt features change meaning (tokenizer, mel or embedding
# extraction): voices stored under another version must be registered again.
FEATURE_VERSION = 1
# The model family whose voices a store itself holds (those stored before other families
# could be served); another family's are in a table of their own (VoiceStore.for_family).
DEFAULT_FAMILY = "cosyvoice2"
FAMILY_NAME = re.compile(r"[a-z0-9]{1,32}")


class VoiceStoreError(CosyserveError):
    """The voice database cannot be opened or read, or a stored voice is unusable."""

    code = "voice_store_error"


class VoiceStoreUnavailableError(VoiceStoreError):
    """The voice database cannot be reached now (a lost connection, a timeout): worth a retry."""

    code = "voice_store_unavailable"


@dataclass(frozen=True)
class VoiceInfo:
    """What a listing shows about a registered voice (no feature arrays)."""

    name: str
    prompt_text: str
    audio_sha256: str
    created_at: float  # Unix seconds


class VoiceStore(ABC):
    """Registered voices, kept across restarts; implements
    :class:`~cosyserve.server.service.VoiceRegistry`.

    Thread-safe. Names are checked by :func:`~cosyserve.pipeline.voice.check_voice_name`
    (:class:`~cosyserve.errors.InvalidRequestError` otherwise). A voice stored under another
    :data:`FEATURE_VERSION`, or a damaged one, raises :class:`VoiceStoreError` when read.
    Close with :meth:`close` (or a ``with`` block).
    """

    @property
    @abstractmethod
    def location(self) -> str:
        """Where the voices are, fit for a log line (a URL's password is masked)."""

    @abstractmethod
    def put(self, voice: VoicePrompt, *, replace: bool = False) -> None:
        """Store ``voice`` under ``voice.name``. An existing voice of that name raises
        :class:`~cosyserve.pipeline.voice.VoiceExistsError` unless ``replace`` (the
        caller decides; the service's ``add_voice`` never replaces)."""

    @abstractmethod
    def get(self, name: str) -> VoicePrompt | None:
        """The voice called ``name``, or None if there is none."""

    @abstractmethod
    def delete(self, name: str) -> bool:
        """Remove ``name``; False if there was no such voice."""

    @abstractmethod
    def names(self) -> list[str]:
        """Every registered name, sorted."""

    @abstractmethod
    def info(self, name: str) -> VoiceInfo | None:
        """:class:`VoiceInfo` of ``name``, or None if there is no such voice."""

    @abstractmethod
    def list_info(self) -> list[VoiceInfo]:
        """:class:`VoiceInfo` of every registered voice, sorted by name."""

    @abstractmethod
    def close(self) -> None:
        """Release the database connections; calls after it raise :class:`VoiceStoreError`.
        A :meth:`for_family` view's does nothing: the store that made it owns them."""

    def for_family(self, family: str) -> "VoiceStore":
        """The voices of model family ``family`` (``cosyvoice2``, ``cosyvoice3``): their
        prompt features come from the family's own speech tokenizer, so one stored voice
        cannot serve two families. :data:`DEFAULT_FAMILY`'s are this store itself; another
        family's are a view of this store on a table of their own (made if missing),
        sharing its connections. Same names, independent entries."""
        if family == DEFAULT_FAMILY:
            return self
        raise VoiceStoreError(f"this voice store keeps no voices of model family {family!r}")

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
