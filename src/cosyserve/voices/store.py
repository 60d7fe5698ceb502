"""The voice registry on SQLite: a registered voice's prompt features are computed once,
survive restarts and are shared by every transport and worker thread.

Schema (table ``voices``, one row per voice, ``PRAGMA user_version`` = schema version):

======================  =======  ==============================================================
column                  type     content
======================  =======  ==============================================================
name                    TEXT     primary key; 1-64 letters, digits, ``_`` or ``-``
prompt_text             TEXT     the normalised transcript ("" for cross-lingual-only voices)
prompt_text_ids         BLOB     ``.npy`` (T,) int64, Qwen2 ids of ``prompt_text``
speech_tokens           BLOB     ``.npy`` (L,) int64, 25 Hz prompt speech tokens
mel                     BLOB     ``.npy`` (2L, 80) float32, 24 kHz prompt log-mel
embedding               BLOB     ``.npy`` (192,) float32, CAM++ speaker embedding
audio_sha256            TEXT     hex SHA-256 of the prompt file as uploaded
created_at              REAL     Unix seconds of registration
feature_version         INTEGER  :data:`FEATURE_VERSION` when the features were computed
======================  =======  ==============================================================

Arrays are NumPy ``.npy`` bytes, read with ``allow_pickle=False``: a database file can
never make the server run code, and values come back bit for bit.
"""

import io
import logging
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import numpy as np
import torch
from numpy.typing import NDArray

from cosyserve.errors import CosyserveError
from cosyserve.pipeline.voice import VoiceExistsError, VoicePrompt, check_voice_name

logger = logging.getLogger(__name__)

# Bump when the frontend's prompt features change meaning (tokenizer, mel or embedding
# extraction): voices stored under another version must be registered again.
FEATURE_VERSION = 1
_SCHEMA_VERSION = 1
# Seconds a write waits for another process's write lock (several workers, one file).
_BUSY_TIMEOUT_S = 10.0

_COLUMNS = (
    "name",
    "prompt_text",
    "prompt_text_ids",
    "speech_tokens",
    "mel",
    "embedding",
    "audio_sha256",
    "created_at",
    "feature_version",
)
_COLUMN_LIST = ", ".join(_COLUMNS)
_CREATE = """
CREATE TABLE voices (
    name TEXT PRIMARY KEY NOT NULL,
    prompt_text TEXT NOT NULL,
    prompt_text_ids BLOB NOT NULL,
    speech_tokens BLOB NOT NULL,
    mel BLOB NOT NULL,
    embedding BLOB NOT NULL,
    audio_sha256 TEXT NOT NULL,
    created_at REAL NOT NULL,
    feature_version INTEGER NOT NULL
)
"""


class VoiceStoreError(CosyserveError):
    """The voice database cannot be opened or read, or a stored voice is unusable."""

    code = "voice_store_error"


@dataclass(frozen=True)
class VoiceInfo:
    """What a listing shows about a registered voice (no feature arrays)."""

    name: str
    prompt_text: str
    audio_sha256: str
    created_at: float  # Unix seconds


class VoiceStore:
    """Registered voices in one SQLite file (WAL mode); implements
    :class:`~cosyserve.server.service.VoiceRegistry`.

    Thread-safe: one connection, used under a lock (calls come from the event loop and
    the frontend thread pool; each is a single short statement). Several processes may
    share the file. Opening a file that is not a voice database raises
    :class:`VoiceStoreError`; so does reading a corrupt row or one stored under another
    :data:`FEATURE_VERSION`. Close with :meth:`close` (or a ``with`` block).
    """

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # isolation_level=None: every statement commits by itself; each call is one statement.
            self._conn = sqlite3.connect(
                self.path, timeout=_BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
            )
        except (OSError, sqlite3.Error) as exc:
            raise VoiceStoreError(f"cannot open the voice database {self.path}: {exc}") from exc
        try:
            self._prepare()
        except (sqlite3.Error, VoiceStoreError) as exc:
            self._conn.close()
            if isinstance(exc, VoiceStoreError):
                raise
            raise VoiceStoreError(f"cannot open the voice database {self.path}: {exc}") from exc

    def _prepare(self) -> None:
        conn = self._conn
        conn.execute("PRAGMA journal_mode=WAL")
        version = int(conn.execute("PRAGMA user_version").fetchone()[0])
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if version == 0 and not tables:
            conn.executescript(f"BEGIN; {_CREATE}; PRAGMA user_version = {_SCHEMA_VERSION}; COMMIT;")
            return
        if version != _SCHEMA_VERSION:
            raise VoiceStoreError(
                f"{self.path} is not a cosyserve voice database of schema version {_SCHEMA_VERSION}"
                f" (found user_version {version})"
            )
        columns = tuple(row[1] for row in conn.execute("PRAGMA table_info(voices)"))
        if columns != _COLUMNS:
            raise VoiceStoreError(f"{self.path}: the voices table has unexpected columns {columns}")

    # -- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- the registry -----------------------------------------------------------------------

    def put(self, voice: VoicePrompt, *, replace: bool = False) -> None:
        """Store ``voice`` under ``voice.name``. An existing voice of that name raises
        :class:`~cosyserve.pipeline.voice.VoiceExistsError` unless ``replace`` (the
        caller decides; the service's ``add_voice`` never replaces)."""
        check_voice_name(voice.name)
        row = (
            voice.name,
            voice.prompt_text,
            _to_npy(np.asarray(voice.prompt_text_ids, dtype=np.int64)),
            _to_npy(voice.speech_tokens.detach().to("cpu", torch.int64).reshape(-1).numpy()),
            _to_npy(voice.mel.detach().to("cpu", torch.float32).numpy()),
            _to_npy(voice.embedding.detach().to("cpu", torch.float32).reshape(-1).numpy()),
            voice.audio_sha256,
            time.time(),
            FEATURE_VERSION,
        )
        verb = "INSERT OR REPLACE" if replace else "INSERT"
        placeholders = ", ".join("?" * len(_COLUMNS))
        try:
            with self._locked():
                self._conn.execute(f"{verb} INTO voices ({_COLUMN_LIST}) VALUES ({placeholders})", row)
        except sqlite3.IntegrityError:
            raise VoiceExistsError(f"voice {voice.name!r} already exists") from None

    def get(self, name: str) -> VoicePrompt | None:
        """The voice called ``name``, or None if there is none."""
        check_voice_name(name)
        with self._locked():
            row = self._conn.execute(f"SELECT {_COLUMN_LIST} FROM voices WHERE name = ?", (name,)).fetchone()
        return None if row is None else _voice_from_row(row)

    def delete(self, name: str) -> bool:
        """Remove ``name``; False if there was no such voice."""
        check_voice_name(name)
        with self._locked():
            cursor = self._conn.execute("DELETE FROM voices WHERE name = ?", (name,))
        return cursor.rowcount > 0

    def names(self) -> list[str]:
        """Every registered name, sorted."""
        with self._locked():
            rows = self._conn.execute("SELECT name FROM voices ORDER BY name").fetchall()
        return [str(row[0]) for row in rows]

    def info(self, name: str) -> VoiceInfo | None:
        check_voice_name(name)
        with self._locked():
            row = self._conn.execute(
                "SELECT name, prompt_text, audio_sha256, created_at FROM voices WHERE name = ?", (name,)
            ).fetchone()
        return None if row is None else _info_from_row(row)

    def list_info(self) -> list[VoiceInfo]:
        """:class:`VoiceInfo` of every registered voice, sorted by name."""
        with self._locked():
            rows = self._conn.execute(
                "SELECT name, prompt_text, audio_sha256, created_at FROM voices ORDER BY name"
            ).fetchall()
        return [_info_from_row(row) for row in rows]

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """Serialise use of the connection; database failures become :class:`VoiceStoreError`
        (details logged, not shown to clients)."""
        with self._lock:
            try:
                yield
            except sqlite3.IntegrityError:
                raise
            except sqlite3.Error as exc:
                logger.error("voice database %s failed: %s", self.path, exc)
                raise VoiceStoreError("the voice database failed") from exc


def _to_npy(array: NDArray[np.generic]) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
    return buffer.getvalue()


def _from_npy(blob: object, dtype: type[np.generic], ndim: int) -> NDArray[np.generic]:
    if not isinstance(blob, bytes):
        raise ValueError(f"expected a BLOB, found {type(blob).__name__}")
    array = np.load(io.BytesIO(blob), allow_pickle=False)
    if array.dtype != np.dtype(dtype) or array.ndim != ndim:
        raise ValueError(f"expected {ndim}-D {np.dtype(dtype)}, found {array.ndim}-D {array.dtype}")
    # np.load may hand back a read-only view of the blob; torch tensors must own writable memory.
    return np.array(array, copy=True)


def _voice_from_row(row: Sequence[Any]) -> VoicePrompt:
    name, prompt_text, text_ids, tokens, mel, embedding, sha256, _, version = row
    if version != FEATURE_VERSION:
        raise VoiceStoreError(
            f"voice {name!r} was stored with feature format {version} and this server reads"
            f" {FEATURE_VERSION}; delete it and register it again"
        )
    try:
        ids = _from_npy(text_ids, np.int64, 1)
        voice = VoicePrompt(
            prompt_text_ids=tuple(int(i) for i in ids.tolist()),
            speech_tokens=torch.from_numpy(_from_npy(tokens, np.int64, 1)),
            mel=torch.from_numpy(_from_npy(mel, np.float32, 2)),
            embedding=torch.from_numpy(_from_npy(embedding, np.float32, 1)),
            name=str(name),
            audio_sha256=str(sha256),
            prompt_text=str(prompt_text),
        )
    except (ValueError, OSError, EOFError) as exc:
        logger.error("stored voice %r is corrupt: %s", name, exc)
        raise VoiceStoreError(f"stored voice {name!r} is corrupt; delete it and register it again") from None
    return voice


def _info_from_row(row: Sequence[Any]) -> VoiceInfo:
    name, prompt_text, sha256, created_at = row
    return VoiceInfo(str(name), str(prompt_text), str(sha256), float(created_at))
