"""What the benchmark scripts share: their command-line arguments, how a waveform differs
from a reference, and two ways of timing alternatives in turns so that a machine whose
speed drifts during a run slows each alike.

- :func:`interleaved`: variants of the same work in one process, call after call.
- :class:`Turns` and :func:`take_turns`: worker processes that run their steps one at a
  time, in turn. A worker (:class:`Turns`) writes :data:`READY` on stdout before each step
  and reads one line from stdin before it runs it; its last stdout line is its report. The
  parent (:func:`take_turns`) starts every worker, then lets them run each step in turn,
  waiting for one to be ready again (its step done) before the next may go.

The scripts import it as ``common``: ``benchmarks/`` is on the path when they run.
"""

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, TypeVar

import numpy as np

T = TypeVar("T")


def model_dir_parser(doc: str | None) -> argparse.ArgumentParser:
    """The parser of a script described by ``doc`` that runs on a model directory:
    ``--model-dir``, and ``--json``, a file the script also writes its report to."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--json", type=Path)
    return parser


def model_parser(doc: str | None) -> argparse.ArgumentParser:
    """:func:`model_dir_parser` for a script that loads the model in one precision:
    ``--dtype`` (bf16) and ``--quantize`` (int8)."""
    parser = model_dir_parser(doc)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--quantize", default="int8")
    return parser


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """The workload of docs/performance.md: ``--prompt`` speech tokens (75: 3 s) and
    ``--tokens`` speech tokens (150: 6 s of audio)."""
    parser.add_argument("--prompt", type=int, default=75, help="prompt speech tokens (3 s)")
    parser.add_argument("--tokens", type=int, default=150, help="speech tokens (6 s of audio)")


def wave_errors(reference: np.ndarray, wave: np.ndarray) -> dict[str, float]:
    """How ``wave`` differs from ``reference`` (as long): the largest and the mean absolute
    difference, and the SNR in dB (infinite where they are equal)."""
    diff = wave - reference
    noise = float((diff**2).sum())
    snr = float("inf") if noise == 0 else 10 * float(np.log10((reference**2).sum() / noise))
    return {"max_err": float(np.abs(diff).max()), "mean_err": float(np.abs(diff).mean()), "snr_db": snr}


def interleaved(
    variants: Mapping[str, Callable[[], T]], rounds: int, warm_up: int
) -> tuple[dict[str, float], dict[str, T]]:
    """Median ms of each variant's call, the variants taking turns for ``rounds`` rounds of
    which the first ``warm_up`` are not counted; and each variant's last output."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    outputs: dict[str, T] = {}
    for repeat in range(rounds):
        for name, run in variants.items():
            start = time.perf_counter()
            outputs[name] = run()
            if repeat >= warm_up:
                times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}, outputs


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
