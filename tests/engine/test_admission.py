"""The one admission gate: places are taken at once or refused, and always given back."""

import threading

import pytest

from cosyserve.engine.admission import Admission, OverloadedError


def test_places_up_to_capacity_then_refused_at_once() -> None:
    gate = Admission(2)
    with gate.place(), gate.place():
        assert gate.held == 2
        with pytest.raises(OverloadedError), gate.place():
            pass
        assert gate.held == 2  # a refusal holds nothing
    assert gate.held == 0
    with gate.place():  # room again
        assert gate.held == 1


def test_a_failing_request_gives_its_place_back() -> None:
    gate = Admission(1)
    with pytest.raises(RuntimeError), gate.place():
        raise RuntimeError("the request failed")
    assert gate.held == 0


def test_threads_never_exceed_capacity() -> None:
    gate = Admission(3)
    most = 0
    lock = threading.Lock()
    start = threading.Barrier(8)

    def request() -> None:
        nonlocal most
        start.wait()
        for _ in range(200):
            try:
                with gate.place(), lock:
                    most = max(most, gate.held)
            except OverloadedError:
                pass

    threads = [threading.Thread(target=request) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert 1 <= most <= 3 and gate.held == 0


def test_capacity_must_hold_one_request() -> None:
    with pytest.raises(ValueError, match="capacity"):
        Admission(0)
