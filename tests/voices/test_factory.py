"""``open_voice_store``: a ``voices_db`` value names its store; ``@FILE`` reads it from a file."""

import sys
from pathlib import Path

import pytest

from cosyserve.voices import VoiceStoreError, open_voice_store
from cosyserve.voices.postgres import PostgresVoiceStore
from cosyserve.voices.sqlite import SqliteVoiceStore
from tests.postgres import PostgresServer


@pytest.mark.parametrize("as_path", [True, False])
def test_a_path_is_an_sqlite_file(tmp_path: Path, as_path: bool) -> None:
    path = tmp_path / "sub" / "voices.sqlite3"
    with open_voice_store(path if as_path else str(path)) as store:
        assert isinstance(store, SqliteVoiceStore) and store.location == str(path)
    assert path.is_file()


def test_a_postgresql_url_is_the_shared_store(postgres: PostgresServer, tmp_path: Path) -> None:
    url = postgres.new_database()
    secret = tmp_path / "voices_db"
    secret.write_text(f"{url}\n")
    for location in (url, url.replace("postgresql://", "postgres://", 1), f"@{secret}"):
        with open_voice_store(location) as store:
            assert isinstance(store, PostgresVoiceStore)
            assert postgres.password not in store.location and ":***@127.0.0.1" in store.location


def test_an_at_file_that_cannot_be_read_is_refused(tmp_path: Path) -> None:
    with pytest.raises(VoiceStoreError, match="cannot read the voices_db file"):
        open_voice_store(f"@{tmp_path / 'missing'}")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(VoiceStoreError, match="is empty"):
        open_voice_store(f"@{tmp_path / 'empty'}")


def test_without_the_postgres_extra_the_error_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    # As if psycopg were not installed: importing it fails, as it does then.
    monkeypatch.setitem(sys.modules, "psycopg", None)
    monkeypatch.delitem(sys.modules, "cosyserve.voices.postgres")
    with pytest.raises(VoiceStoreError, match=r"pip install 'cosyserve\[postgres\]'"):
        open_voice_store("postgresql://app:pw@127.0.0.1:1/voices")
