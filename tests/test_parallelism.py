"""Per-thread torch thread counts: pinned counts hold whatever other threads set, and
loading runs on a thread that ends."""

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

import cosyserve.engine.loader
from cosyserve.engine.loader import LoadedModel, load_model
from cosyserve.parallelism import call_on_own_thread, hand_over_threads, pin_torch_threads

T = TypeVar("T")


@pytest.fixture(autouse=True)
def restore_process_count() -> Iterator[None]:
    """Pinning also sets torch's process-wide count; later tests get the suite's back."""
    count = torch.get_num_threads()
    yield
    torch.set_num_threads(count)


def on_thread(fn: Callable[[], T]) -> T:
    out: list[T] = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join()
    return out[0]


def test_a_pinned_count_holds_when_other_threads_set_theirs() -> None:
    pinned = threading.Event()
    others_done = threading.Event()

    def pinned_thread() -> tuple[int, int]:
        pin_torch_threads(3)
        before = torch.get_num_threads()
        pinned.set()
        others_done.wait(10)
        return before, torch.get_num_threads()

    def other() -> None:
        pinned.wait(10)
        torch.set_num_threads(2)  # also the process-wide count
        others_done.set()

    setter = threading.Thread(target=other)
    setter.start()
    assert on_thread(pinned_thread) == (3, 3)
    setter.join()
    # A thread that never pinned takes the process-wide count the other thread left.
    assert on_thread(torch.get_num_threads) == 2


def test_a_thread_that_pinned_before_its_first_op_keeps_its_count() -> None:
    def pin_then_change_elsewhere() -> int:
        pin_torch_threads(1)
        on_thread(lambda: torch.set_num_threads(4))
        torch.ones(1 << 16).sum()  # an op after the process-wide change
        return torch.get_num_threads()

    assert on_thread(pin_then_change_elsewhere) == 1


def test_hand_over_threads_returns_the_count_and_keeps_one() -> None:
    def hand_over() -> tuple[int, int]:
        pin_torch_threads(3)
        return hand_over_threads(), torch.get_num_threads()

    assert on_thread(hand_over) == (3, 1)


def test_pin_refuses_zero() -> None:
    with pytest.raises(ValueError, match="at least one"):
        pin_torch_threads(0)


def test_call_on_own_thread_returns_from_another_thread_with_its_count() -> None:
    caller = threading.current_thread()

    def work() -> tuple[bool, str, int]:
        return threading.current_thread() is caller, threading.current_thread().name, torch.get_num_threads()

    assert call_on_own_thread(work, threads=3, name="loader") == (False, "loader", 3)
    assert not any(t.name == "loader" for t in threading.enumerate())  # it ended


def test_call_on_own_thread_raises_what_the_work_raises() -> None:
    error = KeyError("missing")

    def fail() -> None:
        raise error

    with pytest.raises(KeyError) as info:
        call_on_own_thread(fail, threads=1, name="loader")
    assert info.value is error


def test_load_model_loads_on_a_thread_that_ends(
    monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path
) -> None:
    seen: list[tuple[str, int]] = []
    real = cosyserve.engine.loader._load_model

    def spy(*args: Any) -> LoadedModel:
        seen.append((threading.current_thread().name, torch.get_num_threads()))
        return real(*args)

    monkeypatch.setattr(cosyserve.engine.loader, "_load_model", spy)
    model = load_model(tiny_model_dir, threads=3)
    assert seen == [("cosyserve-load", 3)]
    assert model.hparams.sample_rate == 24000
    assert not any(t.name == "cosyserve-load" for t in threading.enumerate())
