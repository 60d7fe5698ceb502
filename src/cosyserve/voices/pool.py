"""A small pool of PostgreSQL connections for the threads of one server.

A thread takes an idle connection (newest first) or, when none is idle, opens one itself:
while the database cannot be reached, each caller fails within libpq's ``connect_timeout``
on its own instead of queueing behind another caller's attempt, which is what a server
needs to answer 503 promptly. At most ``max_size`` connections are open at once; a caller
beyond that waits up to ``timeout`` seconds for one to come back.
"""

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from psycopg.pq import TransactionStatus
from psycopg.rows import TupleRow

Connection = psycopg.Connection[TupleRow]


class PoolClosedError(RuntimeError):
    """The pool was closed: no connection is handed out any more."""


class PoolTimeoutError(RuntimeError):
    """Every connection stayed in use for the whole wait."""


class ConnectionPool:
    """Autocommit connections to ``conninfo``; thread-safe.

    :meth:`close` closes the idle connections at once and those in use when they come
    back, so no connection outlives the pool.
    """

    def __init__(self, conninfo: str, *, max_size: int, timeout: float) -> None:
        self._conninfo = conninfo
        self._max_size = max_size
        self._timeout = timeout
        self._idle: list[Connection] = []
        self._count = 0  # open connections: idle or in use
        self._closed = False
        self._changed = threading.Condition()

    @property
    def size(self) -> int:
        """How many connections are open, idle or in use."""
        with self._changed:
            return self._count

    @contextmanager
    def connection(self) -> Iterator[Connection]:
        """A connection for one call; it goes back to the pool afterwards (or is closed,
        if it broke or the pool was closed meanwhile)."""
        conn = self._take()
        try:
            yield conn
        finally:
            self._give_back(conn)

    def discard_idle(self) -> None:
        """Close every idle connection: after one turned out lost (a database restart, a
        failover), the others most likely are too."""
        with self._changed:
            idle, self._idle = self._idle, []
            self._count -= len(idle)
            self._changed.notify_all()
        for conn in idle:
            conn.close()

    def close(self) -> None:
        with self._changed:
            self._closed = True
        self.discard_idle()

    def _take(self) -> Connection:
        deadline = time.monotonic() + self._timeout
        with self._changed:
            while True:
                if self._closed:
                    raise PoolClosedError("the connection pool is closed")
                if self._idle:
                    return self._idle.pop()
                if self._count < self._max_size:
                    self._count += 1
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise PoolTimeoutError(f"all {self._max_size} connections busy for {self._timeout} s")
                self._changed.wait(remaining)
        try:  # outside the lock: other callers need not wait for this connect
            return psycopg.connect(self._conninfo, autocommit=True)
        except BaseException:
            with self._changed:
                self._count -= 1
                self._changed.notify()
            raise

    def _give_back(self, conn: Connection) -> None:
        reusable = not conn.closed and conn.info.transaction_status == TransactionStatus.IDLE
        with self._changed:
            if reusable and not self._closed:
                self._idle.append(conn)
                self._changed.notify()
                return
            self._count -= 1
            self._changed.notify()
        conn.close()
