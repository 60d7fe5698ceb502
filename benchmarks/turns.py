"""Worker processes that take turns: each runs its steps only when told, one process at a
time, so that a machine whose speed drifts during a run slows every side alike.

A worker (:class:`Turns`) writes :data:`READY` on stdout before each step and reads one
line from stdin before it runs it; its last stdout line is its report. The parent
(:func:`take_turns`) starts every worker, then lets them run each step in turn, waiting
for one to be ready again (its step done) before the next may go.
"""

import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import IO

READY = "cosyserve-turns: ready"


class Turns:
    """A worker's side: :meth:`wait` before each step (a no-op when not ``taking``)."""

    def __init__(self, taking: bool) -> None:
        self.taking = taking

    def wait(self) -> None:
        if not self.taking:
            return
        print(READY, flush=True)
        if not sys.stdin.readline():
            raise SystemExit("the parent closed the turns' pipe")


def take_turns(commands: Mapping[str, Sequence[str]], steps: int) -> dict[str, str]:
    """Run the worker ``commands`` (each calls :meth:`Turns.wait` ``steps`` times) one step at
    a time: step 1 of each worker in order, then step 2, and so on; then each worker's rest,
    one after another. Returns each worker's last stdout line. Raises RuntimeError if a
    worker ends early or fails; every worker is gone when this returns or raises."""
    workers = {
        name: subprocess.Popen(list(command), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for name, command in commands.items()
    }
    try:
        for name, worker in workers.items():
            _await_ready(name, worker)
        for _ in range(steps - 1):
            for name, worker in workers.items():
                _go(name, worker)
                _await_ready(name, worker)
        reports = {}
        for name, worker in workers.items():
            _go(name, worker)
            out, _ = worker.communicate()
            lines = out.strip().splitlines()
            if worker.returncode != 0 or not lines:
                raise RuntimeError(f"{name} failed (exit status {worker.returncode})")
            reports[name] = lines[-1]
        return reports
    finally:
        for worker in workers.values():
            if worker.poll() is None:
                worker.kill()
            worker.wait()


def _go(name: str, worker: subprocess.Popen[str]) -> None:
    stdin: IO[str] | None = worker.stdin
    assert stdin is not None
    try:
        stdin.write("go\n")
        stdin.flush()
    except BrokenPipeError:
        raise RuntimeError(f"{name} ended before its turn") from None


def _await_ready(name: str, worker: subprocess.Popen[str]) -> None:
    """Read ``worker``'s stdout up to its next :data:`READY` (other lines are dropped)."""
    stdout: IO[str] | None = worker.stdout
    assert stdout is not None
    for line in stdout:
        if line.rstrip("\n") == READY:
            return
    worker.wait()
    raise RuntimeError(f"{name} ended before its turn (exit status {worker.returncode})")
