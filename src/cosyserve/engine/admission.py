"""The one admission gate: how many requests a process takes at once, and their defaults.

A request holds a place from admission (before its text and prompt audio are prepared) to
its last chunk, whether it synthesises or waits; with every place taken the next request
is refused at once (:class:`OverloadedError`, HTTP 429), never queued without bound.
Torch-free, so the settings can name the defaults.
"""

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from cosyserve.errors import CosyserveError

# Requests synthesising at once, and waiting beyond those.
DEFAULT_MAX_ACTIVE = 8
DEFAULT_MAX_WAITING = 16


class OverloadedError(CosyserveError):
    """Every place is taken: the request is refused at once; retry later."""

    code = "overloaded"


class Admission:
    """At most ``capacity`` places held at once; thread-safe."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, not {capacity}")
        self.capacity = capacity
        self._lock = threading.Lock()
        self._held = 0

    @property
    def held(self) -> int:
        """Places held now: requests admitted and not finished."""
        return self._held

    @contextmanager
    def place(self) -> Iterator[None]:
        """Hold a place for the ``with`` block, or raise :class:`OverloadedError` at once."""
        with self._lock:
            if self._held >= self.capacity:
                raise OverloadedError("the server is at capacity; retry later")
            self._held += 1
        try:
            yield
        finally:
            with self._lock:
                self._held -= 1
