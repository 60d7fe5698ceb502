"""Which threads run torch on several CPU threads, and why only one long-lived one does.

torch runs the parallel part of a CPU op in OpenMP (libgomp), which keeps a pool of
worker threads for every thread that has started a parallel region, until that thread
exits. Once the pools hold more threads than there are CPUs, an idle worker stops
spinning for the next region after 100 spins and sleeps (libgomp's "throttled" spin
count, libgomp/config/linux/wait.h), so each of the many small parallel regions of a
decode step waits for a futex wake-up. On 2 CPUs the engine's decode steps ran 25-50%
slower on its own thread than on the thread that had loaded the model, because that
thread's pool was still there.

So a process keeps one long-lived thread that runs torch multi-threaded, the engine's:
the model loads on a thread of its own that exits when loading ends (its pool goes
with it), and the other threads that touch torch (the thread that starts the engine,
the frontend's workers) run it on one thread, which starts no pool.
"""

import threading
from collections.abc import Callable
from typing import TypeVar

import torch

_T = TypeVar("_T")


def pin_torch_threads(count: int) -> None:
    """From now on this thread's torch ops use ``count`` intra-op threads, whatever other
    threads set later.

    torch copies its process-wide count into a thread the first time that thread asks
    for it, and ``torch.set_num_threads`` sets both this thread's count and the
    process-wide one: asking first means that no later copy overrides ``count``."""
    if count < 1:
        raise ValueError(f"a thread needs at least one torch thread, not {count}")
    torch.get_num_threads()
    torch.set_num_threads(count)


def hand_over_threads() -> int:
    """This thread's torch thread count, for the engine's thread to take; this thread
    then runs torch on one thread. For the thread that starts an engine thread and does
    no model work itself (a server's event loop, a benchmark's client loop)."""
    count = torch.get_num_threads()
    pin_torch_threads(1)
    return count


def call_on_own_thread(fn: Callable[[], _T], *, threads: int, name: str) -> _T:
    """``fn()`` run on a new thread with ``threads`` torch threads, which exits (and its
    OpenMP pool with it) when ``fn`` returns; returns what it returns, raises what it raises."""
    outcome: list[_T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            pin_torch_threads(threads)
            outcome.append(fn())
        except BaseException as exc:  # handed to the caller, which re-raises it
            failure.append(exc)

    # A daemon, so that an interrupted caller (Ctrl-C while loading) can still exit.
    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return outcome[0]
