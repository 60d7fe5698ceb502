"""The PostgreSQL store's connection pool, on the session's throwaway server: reuse, the
size limit and its wait, connections that must not be reused, and close."""

import threading
import time

import psycopg
import pytest

from cosyserve.voices.pool import Connection, ConnectionPool, PoolClosedError, PoolTimeoutError
from tests.postgres import PostgresServer


def _pid(conn: Connection) -> int:
    return int(conn.info.backend_pid)


def _take_pid(pool: ConnectionPool) -> int:
    with pool.connection() as conn:
        return _pid(conn)


def test_an_idle_connection_is_reused(postgres_url: str) -> None:
    pool = ConnectionPool(postgres_url, max_size=2, timeout=1)
    try:
        first = _take_pid(pool)
        with pool.connection() as conn:
            assert _pid(conn) == first and conn.autocommit
        assert pool.size == 1
    finally:
        pool.close()


def test_beyond_max_size_a_caller_times_out(postgres_url: str) -> None:
    pool = ConnectionPool(postgres_url, max_size=2, timeout=0.3)
    try:
        with pool.connection() as a, pool.connection() as b:
            assert _pid(a) != _pid(b) and pool.size == 2
            started = time.monotonic()
            with pytest.raises(PoolTimeoutError), pool.connection():
                pass
            assert 0.25 <= time.monotonic() - started < 2
    finally:
        pool.close()


def test_a_waiting_caller_gets_the_connection_given_back(postgres_url: str) -> None:
    pool = ConnectionPool(postgres_url, max_size=1, timeout=5)
    got: list[int] = []
    try:
        with pool.connection() as held:
            waiter = threading.Thread(target=lambda: got.append(_take_pid(pool)))
            waiter.start()
            time.sleep(0.2)
            assert not got  # waiting: the only connection is in use
            held_pid = _pid(held)
        waiter.join(5)
        assert got == [held_pid] and pool.size == 1
    finally:
        pool.close()


def test_a_connection_mid_transaction_or_broken_is_not_reused(
    postgres: PostgresServer, postgres_url: str
) -> None:
    pool = ConnectionPool(postgres_url, max_size=2, timeout=1)
    try:
        with pool.connection() as conn:
            conn.execute("BEGIN")  # a caller that left a transaction open
            open_transaction = _pid(conn)
        assert pool.size == 0
        with pool.connection() as conn:
            assert _pid(conn) != open_transaction
            with psycopg.connect(postgres.url(), autocommit=True) as admin:
                admin.execute("SELECT pg_terminate_backend(%s)", (_pid(conn),))
            with pytest.raises(psycopg.OperationalError):
                conn.execute("SELECT 1")
            assert conn.broken
        assert pool.size == 0
        assert _take_pid(pool) != open_transaction
    finally:
        pool.close()


def test_close_closes_idle_connections_now_and_busy_ones_when_given_back(postgres_url: str) -> None:
    pool = ConnectionPool(postgres_url, max_size=2, timeout=1)
    with pool.connection() as busy:
        with pool.connection() as idle:
            pass
        pool.close()
        assert idle.closed and not busy.closed and pool.size == 1
        with pytest.raises(PoolClosedError), pool.connection():
            pass
    assert busy.closed and pool.size == 0
