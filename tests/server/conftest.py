"""The real server as a subprocess (``cosyserve serve``) on the tiny model, for HTTP tests.

``server`` is one session-wide server with small limits (max_active 2, max_queued 2) and
gRPC off; tests that need other settings, or that stop the server, start their own with
:func:`running_server`. Every server is stopped at the end (SIGTERM, then SIGKILL).
"""

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from cosyserve.paths import cache_dir

START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 20.0
_LISTENING = re.compile(r"HTTP listening on (http://[\d.]+:\d+)")


@dataclass
class ServerProcess:
    """A running ``cosyserve serve``: its base URL, process and log file."""

    url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_with(self, *needles: str, timeout_s: float = 20.0) -> str:
        """The log once one line holds every one of ``needles``: a request's summary line is
        written after its response has gone out, so a client can be ahead of it."""
        deadline = time.monotonic() + timeout_s
        while True:
            log = self.log()
            if any(all(n in line for n in needles) for line in log.splitlines()):
                return log
            if time.monotonic() > deadline:
                raise AssertionError(f"no log line with {needles} after {timeout_s} s:\n{log[-2000:]}")
            time.sleep(0.05)

    def ready(self) -> httpx.Response:
        return httpx.get(f"{self.url}/ready", timeout=10)


def serve_command(*args: str) -> list[str]:
    """``cosyserve serve ARGS`` with this interpreter (the console script may be absent)."""
    return [sys.executable, "-c", "from cosyserve.cli.main import main; main()", "serve", *args]


def isolated_env(tmp: Path) -> dict[str, str]:
    """The environment without COSYSERVE_* settings, with a private cache directory.

    Only its ``traces`` are the test session's (tests/conftest.py's ``cache_home``): they are
    keyed by model, plan and torch and written atomically, so the servers of a session trace
    the tiny model once instead of at every start."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COSYSERVE_")}
    shared = cache_dir() / "traces"
    shared.mkdir(parents=True, exist_ok=True)
    own = tmp / "cache" / "cosyserve"
    own.mkdir(parents=True, exist_ok=True)
    if not (own / "traces").exists():
        (own / "traces").symlink_to(shared, target_is_directory=True)
    env["XDG_CACHE_HOME"] = str(tmp / "cache")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def server_args(model_dir: Path, tmp: Path, **settings: object) -> list[str]:
    """Flags for a test server: any free port, no gRPC, a private voice database, the exact
    profile;
    ``settings`` are more flags (``max_active=1`` -> ``--max-active 1``)."""
    values: dict[str, object] = {
        "model_dir": model_dir,
        "port": 0,
        "grpc_port": 0,
        "voices_db": tmp / "voices.sqlite3",
        "shutdown_grace": 5,
        "auth_mode": "none",  # auth is on by default; tests/server/auth/ turn it on explicitly
        # The same plan on every CPU, and the in-process references' (load_model's default).
        "profile": "exact",
        **settings,
    }
    args: list[str] = []
    for name, value in values.items():
        args += [f"--{name.replace('_', '-')}", str(value)]
    return args


@contextmanager
def running_server(
    model_dir: Path,
    tmp: Path,
    *,
    on_listening: Callable[[str], None] | None = None,
    **settings: object,
) -> Iterator[ServerProcess]:
    """Start ``cosyserve serve`` and wait until ``/ready`` is 200; always stop it.
    ``on_listening`` gets ``/ready``'s status as soon as the port is open."""
    tmp.mkdir(parents=True, exist_ok=True)
    log_path = tmp / "server.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            serve_command(*server_args(model_dir, tmp, **settings)),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=isolated_env(tmp),
        )
    try:
        server = ServerProcess(_wait_listening(process, log_path), process, log_path)
        if on_listening is not None:
            on_listening(server.ready().json()["status"])  # single process: answers at once
        _wait_ready(server)
        yield server
    finally:
        stop_server(process)


def stop_server(process: subprocess.Popen[bytes]) -> int:
    """SIGTERM, then SIGKILL if it does not exit in time; returns the exit status."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


def _wait_listening(process: subprocess.Popen[bytes], log_path: Path) -> str:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        match = _LISTENING.search(log_path.read_text(errors="replace"))
        if match:
            return match.group(1)
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{log_path.read_text()}")
        time.sleep(0.05)
    raise RuntimeError(f"server did not listen within {START_TIMEOUT_S} s:\n{log_path.read_text()}")


def _wait_ready(server: ServerProcess) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"server exited with {server.process.returncode}:\n{server.log()}")
        try:
            if server.ready().status_code == 200:
                return
        except httpx.TransportError:  # worker processes listen only once they are up
            pass
        time.sleep(0.1)
    raise RuntimeError(f"server not ready within {START_TIMEOUT_S} s:\n{server.log()}")


@pytest.fixture(scope="session")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One shared server: max_active 2, max_queued 2 (capacity 4)."""
    with running_server(
        tiny_model_dir, tmp_path_factory.mktemp("server"), max_active=2, max_queued=2
    ) as process:
        yield process


IDLE_TIMEOUT_S = 60.0


@pytest.fixture(autouse=True)
def _shared_server_idle(request: pytest.FixtureRequest) -> None:
    """Tests on the shared server start with nothing in flight: a client that disconnected
    in an earlier test is only noticed (and its slot freed) a moment later, and a test
    that needs the server's capacity must not meet that leftover as a 429."""
    if "server" not in request.fixturenames:
        return
    server: ServerProcess = request.getfixturevalue("server")
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while time.monotonic() < deadline:
        state = server.ready().json()
        if state.get("in_flight", 0) == 0 and state.get("engine_requests", 0) == 0:
            return
        time.sleep(0.05)
    raise RuntimeError(f"the shared server stayed busy for {IDLE_TIMEOUT_S} s: {state}")
