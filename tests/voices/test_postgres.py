"""What only the PostgreSQL store has: a URL with a password that never shows, a server
that cannot be reached, a connection lost while the store is open, an outage, and its
connection pool."""

import logging
import socket
import threading
import time
import uuid
from contextlib import closing

import psycopg
import pytest

from cosyserve.voices import VoiceStoreError, VoiceStoreUnavailableError
from cosyserve.voices.postgres import MAX_CONNECTIONS, PostgresVoiceStore, conninfo_of, redact_url
from tests.postgres import PostgresServer
from tests.voices.test_store import assert_same_voice, make_voice, run_threads


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://app:s3cr%40t@db.example:5432/voices", "postgresql://app:***@db.example:5432/voices"),
        ("postgres://app@db/voices?sslmode=require", "postgres://app@db/voices?sslmode=require"),
        (
            "postgresql://db/voices?user=app&password=s3cr%40t&sslmode=verify-full",
            "postgresql://db/voices?user=app&password=***&sslmode=verify-full",
        ),
        ("postgresql://app:pw@h1:5432,h2:5433/voices", "postgresql://app:***@h1:5432,h2:5433/voices"),
    ],
)
def test_a_password_in_the_url_is_masked(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_a_malformed_url_is_refused_without_its_password() -> None:
    with pytest.raises(VoiceStoreError, match="invalid voice database URL") as caught:
        PostgresVoiceStore("postgresql://app:hunter2secret@db/voices?no_such_option=1")
    assert "hunter2secret" not in str(caught.value) and "app:***@db" in str(caught.value)


def _closed_port() -> int:
    with closing(socket.socket()) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])  # nothing listens there once it is closed


def test_an_unreachable_server_is_unavailable(caplog: pytest.LogCaptureFixture) -> None:
    url = f"postgresql://app:hunter2secret@127.0.0.1:{_closed_port()}/voices"
    with pytest.raises(VoiceStoreUnavailableError, match="cannot open the voice database") as caught:
        PostgresVoiceStore(url)
    assert "postgresql://app:***@127.0.0.1" in str(caught.value)
    assert "hunter2secret" not in str(caught.value) + caplog.text


def test_a_wrong_password_is_refused_without_showing_it(postgres: PostgresServer) -> None:
    url = postgres.url().replace(postgres.password, "not-the-password-42")
    with pytest.raises(VoiceStoreError, match="password authentication failed") as caught:
        PostgresVoiceStore(url)
    assert "not-the-password-42" not in str(caught.value) and postgres.password not in str(caught.value)


def _backends(admin_url: str, database_url: str, *, terminate: bool = False) -> int:
    """How many connections ``database_url``'s database has (the admin's own is to another
    database); with ``terminate``, cut them all first, as a server restart or a failover would."""
    database = database_url.rsplit("/", 1)[1]
    with psycopg.connect(admin_url, autocommit=True) as admin:
        select = "pg_terminate_backend(pid)" if terminate else "pid"
        rows = admin.execute(f"SELECT {select} FROM pg_stat_activity WHERE datname = %s", (database,))
        return len(rows.fetchall())


def test_a_lost_connection_is_opened_again(
    postgres: PostgresServer, caplog: pytest.LogCaptureFixture
) -> None:
    url = postgres.new_database()
    with PostgresVoiceStore(url) as store, caplog.at_level(logging.WARNING):
        store.put(make_voice("alice"))
        assert _backends(postgres.url(), url, terminate=True) == 1
        assert store.names() == ["alice"]  # a read runs again at once on a new connection
        assert_same_voice(store.get("alice"), make_voice("alice"))
        assert "connection lost, reconnecting" in caplog.text

        # A write checks its connection first, so it too survives the restart (and is
        # not sent twice: a lost reply could hide a committed write).
        assert _backends(postgres.url(), url, terminate=True) == 1
        store.put(make_voice("bob"))
        assert store.delete("alice") is True
        assert store.names() == ["bob"]
    assert postgres.password not in caplog.text


def test_connections_are_pooled_and_all_closed_with_the_store(postgres: PostgresServer) -> None:
    url = postgres.new_database()
    store = PostgresVoiceStore(url)
    try:
        store.put(make_voice("alice", tokens=2))
        barrier = threading.Barrier(2 * MAX_CONNECTIONS)

        def work(_: int) -> None:
            barrier.wait()
            for _ in range(5):
                assert store.get("alice") is not None

        assert run_threads(2 * MAX_CONNECTIONS, work) == []
        # Threads share at most MAX_CONNECTIONS; those stay open for the next calls.
        assert 1 <= store.connections <= MAX_CONNECTIONS
        assert _backends(postgres.url(), url) == store.connections
    finally:
        store.close()
    assert store.connections == 0
    deadline = time.monotonic() + 5  # the server ends a backend a moment after its client left
    while _backends(postgres.url(), url) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _backends(postgres.url(), url) == 0


def test_an_outage_fails_calls_at_once_and_they_work_again_after_it(
    postgres: PostgresServer, caplog: pytest.LogCaptureFixture
) -> None:
    role = f"outage_{uuid.uuid4().hex[:8]}"
    with PostgresVoiceStore(postgres.new_database(owner=role)) as store:
        store.put(make_voice("alice", tokens=2))
        with postgres.outage(role):
            for call in (store.names, lambda: store.get("alice"), lambda: store.put(make_voice("bob"))):
                started = time.monotonic()
                with pytest.raises(VoiceStoreUnavailableError, match=r"^the voice database is unavailable$"):
                    call()
                assert time.monotonic() - started < 5  # refused at once: no wait for a timeout
        assert store.names() == ["alice"]
    assert "unavailable" in caplog.text and postgres.password not in caplog.text


def test_the_urls_options_come_after_the_stores_timeouts(postgres: PostgresServer) -> None:
    url = postgres.new_database()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA voice_data")
    with PostgresVoiceStore(f"{url}?options=-csearch_path%3Dvoice_data") as store:
        store.put(make_voice("alice", tokens=2))
    with psycopg.connect(conninfo_of(f"{url}?options=-csearch_path%3Dvoice_data")) as conn:
        settings = (
            conn.execute("SHOW statement_timeout").fetchone(),
            conn.execute("SHOW search_path").fetchone(),
        )
        assert settings == (("10s",), ("voice_data",))
        found = conn.execute("SELECT to_regclass('voice_data.cosyserve_voices') IS NOT NULL").fetchone()
        assert found == (True,)
