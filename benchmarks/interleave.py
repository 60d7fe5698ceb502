"""Timing variants of the same work in turns, so that a machine whose speed drifts during a
run slows each of them alike."""

import statistics
import time
from collections.abc import Callable, Mapping
from typing import TypeVar

T = TypeVar("T")


def interleaved(
    variants: Mapping[str, Callable[[], T]], undo: Callable[[], None], rounds: int, warm_up: int
) -> tuple[dict[str, float], dict[str, T]]:
    """Median ms of each variant's call, the variants taking turns for ``rounds`` rounds of
    which the first ``warm_up`` are not counted, ``undo()`` after each call; and each
    variant's last output."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    outputs: dict[str, T] = {}
    for repeat in range(rounds):
        for name, run in variants.items():
            start = time.perf_counter()
            outputs[name] = run()
            if repeat >= warm_up:
                times[name].append((time.perf_counter() - start) * 1e3)
            undo()
    return {name: statistics.median(t) for name, t in times.items()}, outputs
