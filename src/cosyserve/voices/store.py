"""What every voice store offers: :class:`VoiceStore`, its errors and :class:`VoiceInfo`.

Two stores implement it: :class:`~cosyserve.voices.sqlite.SqliteVoiceStore` (one file,
the default for one machine) and :class:`~cosyserve.voices.postgres.PostgresVoiceStore`
(one database that every replica shares). :func:`~cosyserve.voices.factory.open_voice_store`
picks one from the ``voices_db`` setting. Both keep the same columns
(:data:`cosyserve.voices.rows.COLUMNS`) and the same ``.npy`` feature encoding.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass
from types import TracebackType
from typing import Self

from cosyserve.errors import CosyserveError
from cosyserve.pipeline.voice import VoicePrompt

# Bump when the frontend's prompt features change meaning (tokenizer, mel or embedding
# extraction): voices stored under another version must be registered again.
FEATURE_VERSION = 1


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
        """Release the database connections; calls after it raise :class:`VoiceStoreError`."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
