"""Freed tensor memory stays in the process for the next tensors (glibc)."""

import resource
import threading

import pytest
import torch

from cosyserve.memory import retain_freed_memory


def _faults_of_two_rounds() -> tuple[int, int]:
    """Page faults of writing 256 tensors of 1 MiB, twice (all freed in between), on a
    thread of its own (its own malloc arena, as the engine's thread)."""
    faults: list[int] = []

    def rounds() -> None:
        for _ in range(2):
            before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            tensors = [torch.empty(1 << 20, dtype=torch.uint8).fill_(1) for _ in range(256)]
            faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
            del tensors

    thread = threading.Thread(target=rounds)
    thread.start()
    thread.join()
    return faults[0], faults[1]


def test_freed_memory_is_reused_without_page_faults() -> None:
    if not retain_freed_memory():
        pytest.skip("the C library is not glibc")
    first, second = _faults_of_two_rounds()
    # The first round faults its new pages in (256 MiB: 65,536 pages, faulted a few at a
    # time); glibc's defaults fault as many again in the second (measured: 32,800 both),
    # retained memory a few percent of them (1,400-5,600 of 32,800-45,400 measured).
    assert first > 256 * 64
    assert second < first // 4
