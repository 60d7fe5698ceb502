"""A throwaway PostgreSQL server for tests, from Debian's ``postgresql`` package
(scripts/install installs it): a temporary data directory, a free localhost port, a user
with a password (scram-sha-256 over TCP, as in production), stopped and deleted at the end.

PostgreSQL refuses to run as root, so as root the server runs as the ``postgres`` user.
"""

import glob
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path

_BINARIES = "/usr/lib/postgresql/*/bin"
_USER = "cosyserve"
_START_TIMEOUT_S = 60


class PostgresMissingError(RuntimeError):
    """Debian's PostgreSQL server binaries are not installed."""


@dataclass(frozen=True)
class PostgresServer:
    """A running server: ``url(database)`` connects as a user with a password."""

    port: int
    user: str
    password: str

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{self.user}:{self.password}@127.0.0.1:{self.port}/{database}"

    def new_database(self, owner: str | None = None) -> str:
        """The URL of a new, empty database; with ``owner``, a new role of that name (with a
        password of its own) owns it and the URL logs in as it. The collation is English's,
        as a production database's often is, where code point order (the stores' promise)
        is not the default."""
        import psycopg  # the `postgres` extra; only the tests that use a database need it

        name = f"test_{uuid.uuid4().hex[:12]}"
        user, password = owner or self.user, secrets.token_urlsafe(16) if owner else self.password
        with psycopg.connect(self.url(), autocommit=True) as conn:
            if owner:
                conn.execute(f"CREATE ROLE {owner} LOGIN PASSWORD '{password}'")
            conn.execute(
                f"CREATE DATABASE {name} OWNER {user}"
                " TEMPLATE template0 LOCALE_PROVIDER icu ICU_LOCALE 'en-US'"
            )
        return f"postgresql://{user}:{password}@127.0.0.1:{self.port}/{name}"

    @contextmanager
    def outage(self, role: str) -> Iterator[None]:
        """Inside: the database is down for ``role`` (a role of :meth:`new_database`): its
        connections are cut and new ones refused. Afterwards it may log in again."""
        import psycopg

        with psycopg.connect(self.url(), autocommit=True) as admin:
            admin.execute(f"ALTER ROLE {role} NOLOGIN")
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (role,)
            )
        try:
            yield
        finally:
            with psycopg.connect(self.url(), autocommit=True) as admin:
                admin.execute(f"ALTER ROLE {role} LOGIN")


def server_binaries() -> Path:
    """The newest installed PostgreSQL's bin directory (with initdb and pg_ctl)."""
    found = sorted(
        (Path(d) for d in glob.glob(_BINARIES) if (Path(d) / "initdb").is_file()),
        key=lambda d: int(d.parent.name) if d.parent.name.isdigit() else 0,
    )
    if not found:
        raise PostgresMissingError(
            f"no PostgreSQL server binaries ({_BINARIES}/initdb): install Debian's package with "
            "`apt-get install -y --no-install-recommends postgresql` (scripts/install does)"
        )
    return found[-1]


@contextmanager
def throwaway_postgres(binaries: Path) -> Iterator[PostgresServer]:
    """Start a server from ``binaries`` (:func:`server_binaries`); always stop and delete it."""
    # Not under pytest's temporary directory: its folders are root's, closed to other users.
    root = Path(tempfile.mkdtemp(prefix="cosyserve-postgres-"))
    try:
        data, sockets, password = root / "data", root / "sockets", secrets.token_urlsafe(16)
        sockets.mkdir()
        (root / "password").write_text(password)
        as_owner: list[str] = []
        if os.geteuid() == 0:
            for path in (root, sockets, root / "password"):
                shutil.chown(path, "postgres", "postgres")
            as_owner = ["runuser", "-u", "postgres", "--"]

        def run(*args: str | Path, check: bool = True) -> None:
            done = subprocess.run(
                [*as_owner, *map(str, args)], cwd=root, capture_output=True, timeout=_START_TIMEOUT_S
            )
            if check and done.returncode != 0:
                log = (root / "log").read_text(errors="replace") if (root / "log").exists() else ""
                command = Path(args[0]).name
                raise RuntimeError(f"{command} failed ({done.returncode}): {done.stderr.decode()}{log}")

        run(
            binaries / "initdb", "-D", data, "-U", _USER, "--pwfile", root / "password",
            "--auth-local=trust", "--auth-host=scram-sha-256", "-E", "UTF8", "--locale=C", "--no-sync",
        )  # fmt: skip
        port = _free_port()
        # Durability off: a test server's data is thrown away, and fsyncs would slow every test.
        options = (
            f"-p {port} -k {sockets} -c listen_addresses=127.0.0.1 -c fsync=off"
            " -c synchronous_commit=off -c full_page_writes=off"
        )
        try:
            run(binaries / "pg_ctl", "-D", data, "-l", root / "log", "-o", options, "-w", "start")
            yield PostgresServer(port, _USER, password)
        finally:
            # Immediate: no shutdown checkpoint, since the data is thrown away next.
            run(binaries / "pg_ctl", "-D", data, "-m", "immediate", "-w", "stop", check=False)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _free_port() -> int:
    with closing(socket.socket()) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
