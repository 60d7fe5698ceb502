"""Every store test runs on both stores: ``backend`` is an empty SQLite file or an empty
PostgreSQL database (on the session's throwaway server, tests/postgres.py)."""

import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from cosyserve.voices import VoiceStore, open_voice_store
from cosyserve.voices.postgres import TABLE
from tests.postgres import PostgresServer


@dataclass(frozen=True)
class Backend:
    """Where a test's voices live, and a way around the store to damage them."""

    kind: str  # "sqlite" or "postgres"
    location: str  # what voices_db would say
    table: str

    def open(self) -> VoiceStore:
        return open_voice_store(self.location)

    def execute(self, sql: str, *args: object) -> None:
        """Run ``sql`` (``?`` placeholders, ``{table}`` for the voices table) directly."""
        sql = sql.format(table=self.table)
        if self.kind == "sqlite":
            conn = sqlite3.connect(self.location)
            try:
                conn.execute(sql, args)
                conn.commit()
            finally:
                conn.close()
            return
        import psycopg

        with psycopg.connect(self.location, autocommit=True) as pg:
            pg.execute(sql.replace("?", "%s"), args)


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "sqlite":
        return Backend("sqlite", str(tmp_path / "voices.db"), "voices")
    server: PostgresServer = request.getfixturevalue("postgres")
    return Backend("postgres", server.new_database(), TABLE)


@pytest.fixture
def store(backend: Backend) -> Iterator[VoiceStore]:
    with backend.open() as opened:
        yield opened
