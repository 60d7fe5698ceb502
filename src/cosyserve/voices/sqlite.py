"""The voice store on SQLite: one file, the default for one machine.

Table ``voices`` holds :data:`~cosyserve.voices.rows.COLUMNS` (arrays as ``BLOB``,
``created_at`` as ``REAL``); ``PRAGMA user_version`` is the schema version. Another model
family's voices (:meth:`~cosyserve.voices.VoiceStore.for_family`) are in a table of the same
columns, ``voices_<family>``, made when first asked for.
"""

import logging
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from cosyserve.pipeline.voice import VoiceExistsError, VoicePrompt, check_voice_name
from cosyserve.voices.rows import COLUMN_LIST, COLUMNS, row_of
from cosyserve.voices.store import VoiceStoreError
from cosyserve.voices.table import Row, TableVoiceStore

logger = logging.getLogger(__name__)

_SCHEMA_VERSION = 1
# Seconds a write waits for another process's write lock (several workers, one file).
_BUSY_TIMEOUT_S = 10.0
_CREATE = """
CREATE TABLE {if_missing}{table} (
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


class SqliteVoiceStore(TableVoiceStore):
    """Registered voices in one SQLite file (WAL mode).

    One connection, used under a lock (calls come from the event loop and the frontend
    thread pool; each is a single short statement). Several processes may share the file.
    Opening a file that is not a voice database raises :class:`VoiceStoreError`.
    """

    _table = "voices"
    _param = "?"
    _by_name = "ORDER BY name"

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._closed = False
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
        # Under the write lock: processes that open a new file at once create the table once.
        conn.execute("BEGIN IMMEDIATE")
        try:
            self._check_or_create()
            conn.execute("COMMIT")
        finally:
            if conn.in_transaction:
                conn.execute("ROLLBACK")

    def _check_or_create(self) -> None:
        conn = self._conn
        version = int(conn.execute("PRAGMA user_version").fetchone()[0])
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if version == 0 and not tables:
            conn.execute(_CREATE.format(if_missing="", table="voices"))
            conn.execute(f"PRAGMA user_version = {_SCHEMA_VERSION}")
            return
        if version != _SCHEMA_VERSION:
            raise VoiceStoreError(
                f"{self.path} is not a cosyserve voice database of schema version {_SCHEMA_VERSION}"
                f" (found user_version {version})"
            )
        self._check_columns("voices")

    def _check_columns(self, table: str) -> None:
        columns = tuple(row[1] for row in self._conn.execute(f"PRAGMA table_info({table})"))
        if columns != COLUMNS:
            raise VoiceStoreError(f"{self.path}: the {table} table has unexpected columns {columns}")

    def _ensure_table(self, table: str) -> None:
        with self._locked():
            conn = self._conn
            conn.execute("BEGIN IMMEDIATE")
            try:
                conn.execute(_CREATE.format(if_missing="IF NOT EXISTS ", table=table))
                conn.execute("COMMIT")
            finally:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
            self._check_columns(table)

    @property
    def location(self) -> str:
        return str(self.path)

    def close(self) -> None:
        if self._root is not None:
            return  # a family view: the store that made it closes the connection
        with self._lock:
            self._closed = True
            self._conn.close()

    def put(self, voice: VoicePrompt, *, replace: bool = False) -> None:
        check_voice_name(voice.name)
        verb = "INSERT OR REPLACE" if replace else "INSERT"
        placeholders = ", ".join("?" * len(COLUMNS))
        try:
            self._write(f"{verb} INTO {self._table} ({COLUMN_LIST}) VALUES ({placeholders})", row_of(voice))
        except sqlite3.IntegrityError:
            raise VoiceExistsError(f"voice {voice.name!r} already exists") from None

    def _fetch_one(self, query: str, params: Sequence[object]) -> Row | None:
        with self._locked():
            row: Row | None = self._conn.execute(query, params).fetchone()
        return row

    def _fetch_all(self, query: str) -> list[Row]:
        with self._locked():
            return self._conn.execute(query).fetchall()

    def _write(self, query: str, params: Sequence[object]) -> int:
        with self._locked():
            return self._conn.execute(query, params).rowcount

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """Serialise use of the connection; database failures become :class:`VoiceStoreError`
        (details logged, not shown to clients)."""
        with self._lock:
            if self._owner._closed:
                raise VoiceStoreError("the voice store is closed")
            try:
                yield
            except sqlite3.IntegrityError:
                raise
            except sqlite3.Error as exc:
                logger.error("voice database %s failed: %s", self.path, exc)
                raise VoiceStoreError("the voice database failed") from exc
