"""The voice store a ``voices_db`` setting names: a PostgreSQL URL or an SQLite file."""

from pathlib import Path

from cosyserve.voices.sqlite import SqliteVoiceStore
from cosyserve.voices.store import VoiceStore, VoiceStoreError

_POSTGRES_SCHEMES = ("postgresql://", "postgres://")


def open_voice_store(location: str | Path) -> VoiceStore:
    """Open the store at ``location``: ``postgresql://...`` or ``postgres://...`` (a libpq
    URL) is a :class:`~cosyserve.voices.postgres.PostgresVoiceStore`; anything else is the
    path of a :class:`~cosyserve.voices.sqlite.SqliteVoiceStore` file. ``@FILE`` reads the
    location from FILE's first line, which keeps a URL's password out of the environment
    and the config file (a mounted secret).

    Raises :class:`~cosyserve.voices.store.VoiceStoreError` where the store cannot be opened.
    """
    if isinstance(location, str) and location.startswith("@"):
        location = _read_location(Path(location[1:]))
    if isinstance(location, str) and location.lower().startswith(_POSTGRES_SCHEMES):
        try:  # psycopg is an extra: imported only for a PostgreSQL URL
            from cosyserve.voices.postgres import PostgresVoiceStore
        except ImportError as exc:
            if not (exc.name or "").startswith("psycopg"):
                raise
            raise VoiceStoreError(
                "a PostgreSQL voice database needs psycopg: pip install 'cosyserve[postgres]'"
            ) from None
        return PostgresVoiceStore(location)
    return SqliteVoiceStore(location)


def _read_location(path: Path) -> str:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise VoiceStoreError(f"cannot read the voices_db file {path}: {exc}") from None
    location = lines[0].strip() if lines else ""
    if not location:
        raise VoiceStoreError(f"the voices_db file {path} is empty: write the URL or path on its first line")
    return location
