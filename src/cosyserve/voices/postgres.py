"""The voice store on PostgreSQL: one database that every server and replica shares.

Table ``cosyserve_voices`` (found through the connection's ``search_path``) holds
:data:`~cosyserve.voices.rows.COLUMNS` (arrays as ``BYTEA``, ``created_at`` as
``DOUBLE PRECISION``); its comment names the schema version. The first store to open a
database creates the table, under an advisory lock, so replicas may start at once. Another
model family's voices (:meth:`~cosyserve.voices.VoiceStore.for_family`) are in a table of
the same columns and comment, ``cosyserve_voices_<family>``, made the same way when first
asked for.

Needs the ``postgres`` extra (``pip install 'cosyserve[postgres]'``: psycopg 3).
"""

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit, urlunsplit

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from cosyserve.pipeline.voice import VoiceExistsError, VoicePrompt, check_voice_name
from cosyserve.voices.pool import Connection, ConnectionPool, PoolClosedError, PoolTimeoutError
from cosyserve.voices.rows import COLUMN_LIST, COLUMNS, row_of
from cosyserve.voices.store import VoiceStoreError, VoiceStoreUnavailableError
from cosyserve.voices.table import Row, TableVoiceStore

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

TABLE = "cosyserve_voices"
_SCHEMA_VERSION = 1
_COMMENT = f"cosyserve voices, schema version {_SCHEMA_VERSION}"
# Any fixed number: the key of the advisory lock that serialises creating the table.
_CREATE_LOCK_KEY = 0x636F7379766F6963
# Connections one store (one server process) keeps open at most: voice look-ups are short,
# and a database serves every replica's.
MAX_CONNECTIONS = 4
# A database that does not answer fails a call within seconds instead of holding a server
# thread: connecting, sending (tcp_user_timeout), each statement, waiting for a free connection.
_TIMEOUT_S = 10
# Connection parameters the URL may override.
_DEFAULTS = {
    "connect_timeout": str(_TIMEOUT_S),
    "tcp_user_timeout": str(_TIMEOUT_S * 1000),
    "application_name": "cosyserve",
}
# Server options put before the URL's own `options`, which may override them.
_OPTIONS = f"-c statement_timeout={_TIMEOUT_S * 1000}"
_CREATE = """
CREATE TABLE {table} (
    name TEXT PRIMARY KEY NOT NULL,
    prompt_text TEXT NOT NULL,
    prompt_text_ids BYTEA NOT NULL,
    speech_tokens BYTEA NOT NULL,
    mel BYTEA NOT NULL,
    embedding BYTEA NOT NULL,
    audio_sha256 TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    feature_version INTEGER NOT NULL
)
"""
_VALUES = f"({COLUMN_LIST}) VALUES ({', '.join(['%s'] * len(COLUMNS))})"
_REPLACE = ", ".join(f"{column} = EXCLUDED.{column}" for column in COLUMNS[1:])
# "C": sorted by code point, as SQLite sorts, whatever the database's collation.
_BY_NAME = 'ORDER BY name COLLATE "C"'


def redact_url(url: str) -> str:
    """``url`` with its password, in the user part or a ``password`` parameter, shown as ``***``."""
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
        if parts.password is not None:
            userinfo, _, hosts = netloc.rpartition("@")
            netloc = f"{userinfo.split(':', 1)[0]}:***@{hosts}"
        query = "&".join(
            "password=***" if item.split("=", 1)[0].lower() == "password" else item
            for item in parts.query.split("&")
        )
        return urlunsplit(parts._replace(netloc=netloc, query=query))
    except ValueError:
        return f"{url.split('://', 1)[0]}://***"


def _secrets(url: str) -> list[str]:
    """The password in ``url``, as written and percent-decoded: never shown in a message."""
    try:
        parts = urlsplit(url)
        found = [parts.password or ""]
        found += [
            item.split("=", 1)[1] for item in parts.query.split("&") if item.lower().startswith("password=")
        ]
    except ValueError:
        found = [url]
    return sorted({s for raw in found for s in (raw, unquote(raw)) if s}, key=len, reverse=True)


class _LostConnectionError(Exception):
    """A call's connection was lost, and the call may run again on another."""


def conninfo_of(url: str) -> str:
    """``url`` as a libpq conninfo string with :data:`_DEFAULTS` and :data:`_OPTIONS` where
    the URL does not say otherwise; :class:`psycopg.ProgrammingError` if it is malformed."""
    given = conninfo_to_dict(url)
    options = " ".join(filter(None, [_OPTIONS, str(given.get("options") or "")]))
    return make_conninfo(url, **{k: v for k, v in _DEFAULTS.items() if k not in given}, options=options)


class PostgresVoiceStore(TableVoiceStore):
    """Registered voices in a PostgreSQL database, given by a ``postgresql://`` URL
    (libpq's: ``postgresql://USER:PASSWORD@HOST:PORT/DATABASE?sslmode=require``).

    Calls share a :class:`~cosyserve.voices.pool.ConnectionPool` of up to
    :data:`MAX_CONNECTIONS` connections; each call's statement is its own transaction, so
    stores in other processes and on other machines see each write at once. A database
    that cannot be reached, or does not answer within seconds, raises
    :class:`VoiceStoreUnavailableError`. A connection found lost (a database restart, a
    failover) is replaced: reads run again at once, and writes check their connection
    before writing, since a lost reply could hide a committed write. Messages and log
    lines show the URL with its password masked.
    """

    _table = TABLE
    _param = "%s"
    _by_name = _BY_NAME

    def __init__(self, url: str) -> None:
        self._location = redact_url(url)
        self._secrets = _secrets(url)
        try:
            conninfo = conninfo_of(url)
        except psycopg.Error as exc:
            raise VoiceStoreError(
                f"invalid voice database URL {self._location}: {self._scrub(exc)}"
            ) from None
        self._pool = ConnectionPool(conninfo, max_size=MAX_CONNECTIONS, timeout=_TIMEOUT_S)
        try:
            with self._pool.connection() as conn:
                self._prepare(conn, TABLE)
        except psycopg.Error as exc:
            self.close()
            error = (
                VoiceStoreUnavailableError if isinstance(exc, psycopg.OperationalError) else VoiceStoreError
            )
            raise error(f"cannot open the voice database {self._location}: {self._scrub(exc)}") from None
        except VoiceStoreError:
            self.close()
            raise

    def _ensure_table(self, table: str) -> None:
        self._run(lambda conn: self._prepare(conn, table), write=True)

    def _prepare(self, conn: Connection, table: str) -> None:
        with conn.transaction():
            conn.execute(f"SELECT pg_advisory_xact_lock({_CREATE_LOCK_KEY})")
            oid = _one(conn.execute("SELECT to_regclass(%s)::oid", (table,)).fetchone())
            if oid is None:
                conn.execute(_CREATE.format(table=table))
                conn.execute(f"COMMENT ON TABLE {table} IS '{_COMMENT}'")
                return
            comment = _one(conn.execute("SELECT obj_description(%s::oid, 'pg_class')", (oid,)).fetchone())
            if comment != _COMMENT:
                raise VoiceStoreError(
                    f"{self._location} is not a cosyserve voice database of schema version"
                    f" {_SCHEMA_VERSION} (table {table} has comment {comment!r})"
                )
            rows = conn.execute(
                "SELECT attname FROM pg_attribute WHERE attrelid = %s::oid AND attnum > 0"
                " AND NOT attisdropped ORDER BY attnum",
                (oid,),
            )
            columns = tuple(str(row[0]) for row in rows)
            if columns != COLUMNS:
                raise VoiceStoreError(f"{self._location}: table {table} has unexpected columns {columns}")

    @property
    def location(self) -> str:
        return self._location

    @property
    def connections(self) -> int:
        """How many connections the store holds open now."""
        return self._pool.size

    def close(self) -> None:
        if self._root is None:  # a family view's pool is its store's
            self._pool.close()

    def put(self, voice: VoicePrompt, *, replace: bool = False) -> None:
        check_voice_name(voice.name)
        row = row_of(voice)
        conflict = f"DO UPDATE SET {_REPLACE}" if replace else "DO NOTHING"
        if self._write(f"INSERT INTO {self._table} {_VALUES} ON CONFLICT (name) {conflict}", row) == 0:
            raise VoiceExistsError(f"voice {voice.name!r} already exists")

    def _fetch_one(self, query: str, params: Sequence[object]) -> Row | None:
        return self._run(lambda conn: conn.execute(query, params).fetchone())

    def _fetch_all(self, query: str) -> list[Row]:
        return list(self._run(lambda conn: conn.execute(query).fetchall()))

    def _write(self, query: str, params: Sequence[object]) -> int:
        return self._run(lambda conn: conn.execute(query, params).rowcount, write=True)

    def _run(self, call: Callable[[Connection], _T], *, write: bool = False) -> _T:
        """``call`` on a pooled connection. Database failures become :class:`VoiceStoreError`
        (details logged, password masked; not shown to clients)."""
        try:
            try:
                return self._attempt(call, write=write)
            except _LostConnectionError as lost:
                logger.warning("voice database %s: connection lost, reconnecting (%s)", self._location, lost)
                self._pool.discard_idle()
            return self._attempt(call, write=write)
        except PoolClosedError:
            raise VoiceStoreError("the voice store is closed") from None
        except (_LostConnectionError, PoolTimeoutError, psycopg.OperationalError) as exc:
            logger.error("voice database %s unavailable: %s", self._location, self._scrub(exc))
            raise VoiceStoreUnavailableError("the voice database is unavailable") from None
        except psycopg.Error as exc:
            logger.error("voice database %s failed: %s", self._location, self._scrub(exc))
            raise VoiceStoreError("the voice database failed") from None

    def _attempt(self, call: Callable[[Connection], _T], *, write: bool) -> _T:
        """``call`` once; :class:`_LostConnectionError` where it may run again on another
        connection: a read whose connection was lost, or a write whose connection was lost
        before it was sent (an empty statement shows that first)."""
        with self._pool.connection() as conn:
            if write:
                try:
                    conn.execute("")  # nothing is written yet: a lost connection may be replaced
                except psycopg.OperationalError as exc:
                    if conn.broken:
                        raise _LostConnectionError(self._scrub(exc)) from None
                    raise
            try:
                return call(conn)
            except psycopg.OperationalError as exc:
                if conn.broken and not write:
                    raise _LostConnectionError(self._scrub(exc)) from None
                raise

    def _scrub(self, error: BaseException | str) -> str:
        text = str(error).strip()
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text


def _one(row: Iterable[Any] | None) -> Any:
    """The single value of a one-column row that always exists."""
    assert row is not None
    (value,) = row
    return value
